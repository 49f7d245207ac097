"""A prefill and a decode of different tensor-parallel sizes: the prefill's rank 0 sends whole
blocks (its cache holds every head), the decode's ranks each attend over their heads of the
blocks that arrive, and the continuation equals the single-process engine's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.prefill_cluster import cluster, reference_engine
from support.tiny_models import save_tiny_model

from pdserve.common.generation import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ([(17 * i + 3) % 290 + 5 for i in range(41)], [7, 250, 31, 99, 12, 64, 180, 5])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # NOTE: GQA with two KV heads: one per rank at size 2.
    return save_tiny_model("llama3", tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[int]]:
    engine = reference_engine(model_dir)
    return [engine.generate([prompt], GREEDY)[0] for prompt in PROMPTS]


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
async def test_prefill_and_decode_of_different_sizes_equal_the_engine(
    model_dir: Path, expected: list[list[int]], prefill_tp: int, decode_tp: int, transport: str
) -> None:
    async with cluster(
        model_dir, kv_transports=transport, prefill_tp=prefill_tp, decode_tp=decode_tp
    ) as pd:
        assert pd.prefill.instance.tensor_parallel_size == prefill_tp
        assert pd.decodes[0].instance.tensor_parallel_size == decode_tp
        results = await asyncio.gather(
            *(pd.complete(f"tp-{i}", p, GREEDY) for i, p in enumerate(PROMPTS))
        )
        assert results == expected
        await pd.eventually_whole()
