"""SmolLM2-135M-Instruct's Q4_1 weights (and its Q8_0 tied embedding, the LM head) kept as the
file stores them (``--dtype auto``), against the same file dequantized.

In the dtype ``--dtype auto`` serves on this CPU (`SERVING_DTYPE`): bfloat16 where the CPU has
it natively (the kept weights run with bf16 activations, so they cannot equal float32: they
must be as close to it as the file dequantized to bf16, what ``--quantization none`` serves,
is); float32 elsewhere (the kept weights on pdserve's float32 kernels: the file's values, so
the logits must be the file dequantized to float32's within float32's rounding).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from pdserve.engine import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    SamplingParams,
    ScheduledChunk,
    int8_kernel,
)
from pdserve.engine.linear import Linear
from pdserve.engine.model_store import ResolvedModel
from pdserve.engine.precision import choose_dtype
from pdserve.engine.quant import Int4Linear, Int8GroupEmbedding, Int8GroupLinear, weight_bytes
from pdserve.tokenizer import Tokenizer

MAX_TOKENS = 24
# NOTE: SmolLM2's logits reach 16-32, where one bf16 step is 0.125.
LOGIT_TOLERANCE = 0.25
QUESTIONS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Give me three tips for sleeping well.",
)
SERVING_DTYPE = choose_dtype("auto", torch.device("cpu")).dtype
IS_BF16 = SERVING_DTYPE == "bfloat16"
# NOTE: float32's rounding in logits of 16-32, summed in other orders (prompt rows take a GEMM
# over the weight dequantized exactly, in another GEMM's order): measured 1.4e-4 at most.
FLOAT32_TOLERANCE = 1e-3
SETTINGS = {
    "exact": ("float32", "none"),
    **({"bf16": ("bfloat16", "none")} if IS_BF16 else {}),
    "kept": (SERVING_DTYPE, "auto"),
}


@pytest.fixture(scope="module")
def engines(smollm2: ResolvedModel) -> dict[str, tuple[LLMEngine, list[Any]]]:
    """Each setting's engine and the log events of its loading.

    NOTE: one torch thread, as ``pdserve up`` gives an engine on a host of two cores: pdserve's
    int4 and int8 kernels take the kept weights (with more threads torch's int4 kernel runs and
    the LM head stays bf16).
    """
    loaded = {}
    previous = torch.get_num_threads()
    try:
        for name, (dtype, quantization) in SETTINGS.items():
            config = EngineConfig(
                model=str(smollm2.path),
                dtype=dtype,
                quantization=quantization,
                seed=0,
                cache=CacheConfig(num_blocks=32),
                num_threads=1,
            )
            with capture_logs() as logs:
                loaded[name] = (LLMEngine(config), logs)
    finally:
        torch.set_num_threads(previous)
    return loaded


@pytest.fixture(scope="module")
def prompts(smollm2: ResolvedModel) -> list[list[int]]:
    tokenizer = Tokenizer.from_pretrained(smollm2.path)
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def served(engines: dict[str, Any], prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy completion on the kept weights."""
    return greedy(engines["kept"][0], prompts)


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return engine.generate(prompts, params)


def every_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] float32: row j scores token j + 1."""
    block_ids = engine.block_pool.allocate(-(-len(token_ids) // 16))
    try:
        chunk: ScheduledChunk[Any] = ScheduledChunk(token_ids, 0, block_ids)
        _, every = engine.runner.execute_with_positions([chunk], every_position=(0,))
    finally:
        engine.block_pool.free(block_ids)
    return every[0].float()


def test_every_layer_projection_runs_on_the_files_int4_values(engines: dict[str, Any]) -> None:
    engine, logs = engines["kept"]
    model = engine.runner.model
    projections = [m for m in model.model.layers.modules() if isinstance(m, (Linear, Int4Linear))]
    assert projections and all(isinstance(m, Int4Linear) for m in projections)
    # NOTE: the tied embedding is Q8_0: the LM head runs on pdserve's int8 kernel where it runs
    # (AVX512-BF16), the embedding reading its rows from the same tensors; elsewhere bf16.
    [line] = [event for event in logs if event["event"] == "int4_kernel"]
    if int8_kernel.why_not(getattr(torch, SERVING_DTYPE)) is None:
        assert line["lm_head"] == "int8 (Q8_0, pdserve's kernel)"
        assert isinstance(model.lm_head, Int8GroupLinear)
        assert isinstance(model.model.embed_tokens, Int8GroupEmbedding)
        assert model.model.embed_tokens.values.data_ptr() == model.lm_head.values.data_ptr()
        head_type = "int8"
    else:
        assert line["lm_head"].startswith(f"{SERVING_DTYPE} (Q8_0 dequantized: ")
        assert isinstance(model.lm_head, Linear)
        head_type = SERVING_DTYPE
    [loaded] = [event for event in logs if event["event"] == "model_loaded"]
    assert loaded["tensor_types"] == {"F32": SERVING_DTYPE, "Q4_1": "int4", "Q8_0": head_type}
    dequantized, _ = engines["bf16" if IS_BF16 else "exact"]
    assert weight_bytes(model) < 0.6 * weight_bytes(dequantized.runner.model)


def test_kept_logits_are_as_close_to_the_file_as_its_dtype_allows(
    engines: dict[str, Any], prompts: list[list[int]], served: list[list[int]]
) -> None:
    exact = engines["exact"][0]
    sequences = [p + out for p, out in zip(prompts, served, strict=True)]
    reference = [every_logits(exact, s) for s in sequences]
    errors = {}
    for name in ("bf16", "kept") if IS_BF16 else ("kept",):
        logits = [every_logits(engines[name][0], s) for s in sequences]
        difference = torch.cat([(a - b).abs() for a, b in zip(logits, reference, strict=True)])
        agree = sum(
            int((a.argmax(-1) == b.argmax(-1)).sum())
            for a, b in zip(logits, reference, strict=True)
        )
        errors[name] = (float(difference.max()), float(difference.mean()), agree)
    num_positions = sum(len(s) for s in sequences)
    kept = errors["kept"]
    if IS_BF16:
        bf16 = errors["bf16"]
        assert kept[0] <= 1.5 * bf16[0] and kept[1] <= 1.5 * bf16[1], errors
        assert kept[2] >= 0.95 * num_positions, errors
    else:
        assert kept[0] <= FLOAT32_TOLERANCE, errors
        assert kept[2] >= 0.99 * num_positions, errors


def test_kept_greedy_tokens_are_the_files_best_up_to_ties(
    engines: dict[str, Any], prompts: list[list[int]], served: list[list[int]]
) -> None:
    exact = engines["exact"][0]
    gaps, num_best, num_served = [], 0, 0
    for prompt, tokens in zip(prompts, served, strict=True):
        # steps: [len(tokens), vocab], row j scores the j-th served token
        steps = every_logits(exact, prompt + tokens)[len(prompt) - 1 : -1]
        picked = steps.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        best = steps.max(dim=-1).values
        gaps.append(float((best - picked).max()))
        num_best += int((picked == best).sum())
        num_served += len(tokens)
    assert max(gaps) <= LOGIT_TOLERANCE
    assert num_best >= 0.9 * num_served
