"""SmolLM2-135M-Instruct, the default model, through gateway, prefill and decode processes.

The reference is transformers loading the same GGUF (float32, greedy): the served tokens, the
gateway's chat-template rendering and its tokenization must equal it exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.hf_reference import chat_greedy
from support.process_cluster import ProcessCluster

from pdserve.engine.model_store import DEFAULT_MODEL

MAX_TOKENS = 24
CONVERSATIONS = {
    "question": [{"role": "user", "content": "What is the capital of France?"}],
    "system prompt": [
        {"role": "system", "content": "You are a pirate. Answer in one short sentence."},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Name a primary color."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Name another one, and say why it is primary."},
    ],
}


@pytest.fixture(scope="module")
def cluster(smollm2_processes: ProcessCluster) -> ProcessCluster:
    return smollm2_processes  # NOTE: shared with the other files that only send it requests


def reference(smollm2_reference: tuple[Any, Any], messages: list[dict[str, str]]) -> tuple:
    """(prompt ids, generated ids up to and including the end token) from transformers."""
    return chat_greedy(smollm2_reference, messages, MAX_TOKENS)


def test_the_default_model_is_smollm2(cluster: ProcessCluster, smollm2_gguf: Path) -> None:
    assert cluster.model_name == DEFAULT_MODEL
    assert smollm2_gguf.is_file()


@pytest.mark.parametrize("name", list(CONVERSATIONS))
async def test_greedy_chat_equals_transformers(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any], name: str
) -> None:
    messages = CONVERSATIONS[name]
    prompt_ids, expected = reference(smollm2_reference, messages)
    response = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    extra = choice.model_extra or {}
    # NOTE: the gateway rendered the template and tokenized exactly as transformers does.
    assert extra["prompt_token_ids"] == prompt_ids
    assert extra["token_ids"] == expected
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(expected)


async def test_streaming_chat_stops_at_im_end(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any]
) -> None:
    messages = CONVERSATIONS["question"]
    prompt_ids, expected = reference(smollm2_reference, messages)
    assert expected[-1] == smollm2_reference[0].convert_tokens_to_ids("<|im_end|>")
    stream = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=64,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish_reasons, usage = "", [], None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert text == "The capital of France is Paris."
    assert "<|im_end|>" not in text
    assert finish_reasons == ["stop"]
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), len(expected))
