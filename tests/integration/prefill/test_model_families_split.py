"""Every model family through the split: a real prefill hands its KV to a real decode over each
transport, and the continuation equals the single-process engine's, token for token."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
from support.prefill_cluster import cluster, reference_engine
from support.tiny_models import ARCHITECTURES, pack_fp8, pack_mxfp4, save_tiny_model

from pdserve.common.generation import SamplingParams

# NOTE: the families the engine gained beyond Llama/Qwen2/Mistral (which the other prefill
# tests serve): dense with q/k norm, fused checkpoint projections, experts, Gemma's layers,
# OLMo 2's post-norms and SmolLM3's layers without RoPE.
FAMILIES = (
    "qwen3",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "gemma3",
    "olmo2",
    "smollm3",
    "ernie4_5",
    "ernie4_5_moe",
    "glm4_moe",
    "gpt_oss",
    "deepseek_v3",
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Longer than Gemma's and Mixtral's 24-token windows, so the decode reads a windowed cache.
PROMPTS = ([(17 * i + 3) % 290 + 5 for i in range(41)], [7, 250, 31, 99, 12, 64, 180, 5])


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    assert set(FAMILIES) <= set(ARCHITECTURES)
    return {name: save_tiny_model(name, tmp_path_factory.mktemp(name)) for name in FAMILIES}


@pytest.fixture(scope="module")
def engine_outputs(family_dirs: dict[str, Path]) -> Callable[[str], list[list[int]]]:
    """Returns ``outputs(family)``: the single-process engine's tokens for `PROMPTS`, computed
    once per family for all three transports."""

    @functools.cache
    def outputs(family: str) -> list[list[int]]:
        engine = reference_engine(family_dirs[family])
        return [engine.generate([prompt], GREEDY)[0] for prompt in PROMPTS]

    return outputs


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_a_family_through_the_split_equals_the_engine(
    family_dirs: dict[str, Path],
    engine_outputs: Callable[[str], list[list[int]]],
    family: str,
    transport: str,
) -> None:
    expected = engine_outputs(family)
    async with cluster(family_dirs[family], kv_transports=transport) as pd:
        results = await asyncio.gather(
            *(pd.complete(f"{family}-{i}", p, GREEDY) for i, p in enumerate(PROMPTS))
        )
        assert results == expected
        await pd.eventually_whole()


@pytest.mark.parametrize(
    ("family", "pack"),
    [("gpt_oss", pack_mxfp4), ("deepseek_v3", lambda f, p: pack_fp8(f, p, (16, 16)))],
    ids=["mxfp4", "fp8"],
)
async def test_a_model_as_released_through_the_split_equals_its_float_copy(
    tmp_path: Path, family: str, pack: Callable[[Path, Path], None]
) -> None:
    """The prefill and the decode both read the packed weights (gpt-oss's MXFP4 experts,
    DeepSeek-V3's block FP8: `pdserve.engine.packed_weights`)."""
    floats = save_tiny_model(family, tmp_path / "float")
    pack(floats, tmp_path / "packed")
    engine = reference_engine(floats)
    expected = [engine.generate([prompt], GREEDY)[0] for prompt in PROMPTS]
    async with cluster(tmp_path / "packed", kv_transports="shm") as pd:
        results = await asyncio.gather(
            *(pd.complete(f"packed-{i}", p, GREEDY) for i, p in enumerate(PROMPTS))
        )
        assert results == expected
        await pd.eventually_whole()
