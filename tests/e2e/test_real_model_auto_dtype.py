"""SmolLM2-135M-Instruct served with the default ``--dtype auto`` through gateway, prefill and
decode processes, against transformers in the dtype auto chose.

On a CPU with native bf16 that is bfloat16, where two correct implementations can pick
differently on a near-tie: each served token must be, by transformers' own logits of the
served sequence, within two bf16 steps of its best token (and nearly all are its best). There
the instances also keep the GGUF's Q4_1 weights (and, where pdserve's int8 kernel runs, its
Q8_0 LM head) as the file stores them (``--quantization auto``); transformers computes with the
same file dequantized to bf16.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support.process_cluster import ProcessCluster, events_named, running_cluster

from pdserve.engine.model_store import DEFAULT_MODEL, ResolvedModel
from pdserve.engine.precision import choose_dtype

MAX_TOKENS = 24
# NOTE: SmolLM2's logits reach 16-32, where one bf16 step is 0.125.
LOGIT_TOLERANCE = 0.25
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate. Answer in one short sentence."},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]


@pytest.fixture(scope="module")
def cluster(smollm2: ResolvedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_cluster(smollm2.path, tmp_path_factory.mktemp("logs"), dtype="auto") as running:
        yield running


@pytest.fixture(scope="module")
def auto_reference(smollm2: ResolvedModel) -> torch.nn.Module:
    """transformers' model in the dtype auto picks on this machine."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, choose_dtype("auto", torch.device("cpu")).dtype)
    return AutoModelForCausalLM.from_pretrained(smollm2.path, dtype=dtype).eval()


def test_instances_log_the_dtype_auto_chose(cluster: ProcessCluster) -> None:
    choice = choose_dtype("auto", torch.device("cpu"))
    for child in cluster.instances:
        [event] = events_named(child, "dtype_resolved")
        assert (event["requested"], event["dtype"]) == ("auto", choice.dtype)
        assert event["reason"] == choice.reason
        [loaded] = events_named(child, "model_loaded")
        # NOTE: the file's int4 weights are kept in bf16, and in float32 where pdserve's float32
        # kernels run (AVX2, one torch thread: `test_f32_kernels`); the Q8_0 LM head too where
        # the int8 kernel of that dtype runs. The start-up line says which.
        lines = events_named(child, "int4_kernel")
        is_kept = choice.dtype == "bfloat16" or bool(lines)
        assert len(lines) == int(is_kept)
        kept = head = choice.dtype
        if is_kept:
            kept = "int4"
            if lines[0]["lm_head"] == "int8 (Q8_0, pdserve's kernel)":
                head = "int8"
            else:
                assert lines[0]["lm_head"].startswith(f"{choice.dtype} (Q8_0 dequantized: ")
        assert loaded["tensor_types"] == {"F32": choice.dtype, "Q4_1": kept, "Q8_0": head}


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
async def test_greedy_chat_is_transformers_best_up_to_ties(
    cluster: ProcessCluster, auto_reference: torch.nn.Module, index: int
) -> None:
    model = auto_reference
    messages = CONVERSATIONS[index]
    response = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    extra = response.choices[0].model_extra or {}
    prompt_ids, served = extra["prompt_token_ids"], extra["token_ids"]
    assert served
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + served])).logits[0]
    # steps: [len(served), vocab], row j scores the j-th served token
    steps = logits[len(prompt_ids) - 1 : -1].float()
    picked = steps.gather(1, torch.tensor(served)[:, None]).squeeze(1)
    best = steps.max(dim=-1).values
    assert (best - picked).max() <= LOGIT_TOLERANCE
    assert int((picked == best).sum()) >= 0.9 * len(served)
