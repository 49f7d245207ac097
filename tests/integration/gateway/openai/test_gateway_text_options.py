"""vLLM's text options through the gateway, on REST (the openai SDK) and gRPC (a grpcio stub):
``include_stop_str_in_output``, ``skip_special_tokens`` and ``truncate_prompt_tokens``, against
fakes whose tokenizer is bytes plus four special tokens (256 is the end of sequence)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from support.gateway_cluster import Cluster
from support.gateway_fakes import (
    EOS_TOKEN_ID,
    MAX_MODEL_LEN,
    MODEL_NAME,
    expected_tokens,
    fake_text,
)

from pdserve.common.grpc_server import insecure_channel
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

PROMPT = "hello world"
PROMPT_IDS = list(PROMPT.encode())
USER = 258  # <|user|>, special


async def _complete(pd: Cluster, stream: bool, **body: Any) -> tuple[str, str, Any]:
    """(text, finish_reason, usage) of one completion, streamed or not."""
    client = pd.openai()
    if not stream:
        result = await client.completions.create(model=MODEL_NAME, **body)
        return result.choices[0].text, str(result.choices[0].finish_reason), result.usage
    chunks = [
        chunk
        async for chunk in await client.completions.create(
            model=MODEL_NAME, stream=True, stream_options={"include_usage": True}, **body
        )
    ]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish_reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return text, str(finish_reason), chunks[-1].usage


async def _grpc(pd: Cluster, **fields: Any) -> list[generation_pb2.GenerateResponse]:
    request = generation_pb2.GenerateRequest(model=MODEL_NAME, **fields)
    async with insecure_channel(pd.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return [response async for response in stub.Generate(request)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_stop_string_ends_the_text_when_asked(pd: Cluster, stream: bool) -> None:
    text = fake_text(expected_tokens(PROMPT_IDS, 4, 30))
    stop = text[7:10]
    assert text.find(stop) == 7
    body = {"prompt": PROMPT, "max_tokens": 30, "seed": 4, "stop": [stop]}
    assert (await _complete(pd, stream, **body))[:2] == (text[:7], "stop")
    asked = {**body, "extra_body": {"include_stop_str_in_output": True}}
    output, finish_reason, usage = await _complete(pd, stream, **asked)
    assert (output, finish_reason) == (text[:10], "stop")
    assert usage.completion_tokens == 10


async def test_a_stop_tokens_text_is_left_out_unless_asked(pd: Cluster) -> None:
    reference = expected_tokens(PROMPT_IDS, 2, 20)
    # NOTE: a byte token (text of its own) not seen before, so the completion ends on it.
    index = next(
        i for i, t in enumerate(reference) if i > 1 and 32 < t < 127 and t not in reference[:i]
    )
    stop_id = reference[index]
    body = {"prompt": PROMPT, "max_tokens": 20, "seed": 2}
    extra = {"stop_token_ids": [stop_id], "return_token_ids": True}
    result = await pd.openai().completions.create(model=MODEL_NAME, **body, extra_body=extra)
    choice = result.choices[0]
    assert choice.model_extra["token_ids"] == reference[: index + 1]
    assert (choice.text, choice.finish_reason) == (fake_text(reference[:index]), "stop")
    extra["include_stop_str_in_output"] = True
    result = await pd.openai().completions.create(model=MODEL_NAME, **body, extra_body=extra)
    assert result.choices[0].text == fake_text(reference[: index + 1])
    for include, expected in [(False, reference[:index]), (True, reference[: index + 1])]:
        sampling = common_pb2.SamplingParams(max_tokens=20, seed=2, stop_token_ids=[stop_id])
        responses = await _grpc(
            pd, text=PROMPT, sampling=sampling, include_stop_str_in_output=include
        )
        assert "".join(r.text for r in responses) == fake_text(expected)


async def test_special_tokens_show_when_not_skipped(pd: Cluster) -> None:
    script = (ord("a"), USER, ord("b"))
    for instance in [*pd.prefills, *pd.decodes]:
        instance.knobs.script_ids = script
    messages = [{"role": "user", "content": "hi"}]
    client = pd.openai()
    plain = await client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=9)
    assert plain.choices[0].message.content == "ab"
    shown = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=9, extra_body={"skip_special_tokens": False}
    )
    choice = shown.choices[0]
    # NOTE: the end of sequence ended it: its text stays out.
    assert (choice.message.content, choice.finish_reason) == ("a<|user|>b", "stop")
    stream = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=9,
        stream=True,
        extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True},
    )
    content = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert content == "a<|user|>b<|eos|>"
    responses = await _grpc(
        pd,
        text=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=9),
        skip_special_tokens=False,
    )
    assert "".join(r.text for r in responses) == "a<|user|>b"
    assert [t for r in responses for t in r.token_ids][-1] == EOS_TOKEN_ID


@pytest.mark.parametrize("kept", [5, -1])
async def test_the_prompt_is_cut_to_its_last_tokens(pd: Cluster, kept: int) -> None:
    # NOTE: -1 keeps what leaves room for max_tokens in the model's length (MAX_MODEL_LEN):
    # the prompt is longer than the model, a 400 without it.
    prompt = PROMPT if kept > 0 else "abcdefgh" * (MAX_MODEL_LEN // 8 + 4)
    prompt_ids = list(prompt.encode())
    max_tokens = 6
    count = kept if kept > 0 else MAX_MODEL_LEN - max_tokens
    tail = prompt_ids[-count:]
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "seed": 7, "echo": True}
    if kept < 0:
        with pytest.raises(openai.BadRequestError):
            await pd.openai().completions.create(model=MODEL_NAME, **body)
    result = await pd.openai().completions.create(
        model=MODEL_NAME,
        **body,
        extra_body={"truncate_prompt_tokens": kept, "return_token_ids": True},
    )
    choice = result.choices[0]
    completion = expected_tokens(tail, 7, max_tokens)
    assert choice.model_extra["prompt_token_ids"] == tail
    assert choice.text == fake_text(tail) + fake_text(completion)
    assert result.usage is not None and result.usage.prompt_tokens == count
    assert list(pd.prefills[0].requests[-1].token_ids) == tail
    responses = await _grpc(
        pd,
        text=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, seed=7),
        truncate_prompt_tokens=kept,
        include_prompt_token_ids=True,
    )
    assert list(responses[0].prompt_token_ids) == tail
    assert [t for r in responses for t in r.token_ids] == completion


@pytest.mark.parametrize("kept", [0, -2])
async def test_a_truncation_of_no_tokens_is_refused_by_name(pd: Cluster, kept: int) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        await pd.openai().completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=3,
            extra_body={"truncate_prompt_tokens": kept},
        )
    assert raised.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]
    assert pd.prefills[0].requests == []


async def test_a_chat_without_max_tokens_keeps_half_the_model_for_its_reply(pd: Cluster) -> None:
    # NOTE: -1 with max_tokens unset leaves room for chat's default (1024), at most half the
    # model's length: the templated prompt keeps its last MAX_MODEL_LEN // 2 tokens.
    content = "abcdefgh" * MAX_MODEL_LEN
    templated = [USER, *content.encode(), 259]  # <|user|> ... <|assistant|>
    result = await pd.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": content}],
        seed=3,
        extra_body={"truncate_prompt_tokens": -1},
    )
    kept = MAX_MODEL_LEN // 2
    assert list(pd.prefills[0].requests[-1].token_ids) == templated[-kept:]
    assert result.usage is not None and result.usage.prompt_tokens == kept
    expected = expected_tokens(templated[-kept:], 3, MAX_MODEL_LEN - kept)
    assert result.usage.completion_tokens == len(expected)
