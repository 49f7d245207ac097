"""The prefill's prefix cache between a real prefill and a real decode: a shared prefix is
computed once, the decode still receives the whole prompt's KV, and the output equals the
single-process engine's."""

from __future__ import annotations

from pathlib import Path

import structlog
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.prefill_cluster import BLOCK_SIZE, Cluster, cluster

from pdserve.common.generation import SamplingParams, num_blocks_for
from pdserve.engine.colocated import LLMEngine

PREFIX = [(11 * i + 7) % 290 + 3 for i in range(3 * BLOCK_SIZE)]  # 3 full blocks
FIRST = [*PREFIX, 5, 9, 200]
SECOND = [*PREFIX, 17, 33, 8, 41, 2]  # 4 full blocks and one token
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=3, max_tokens=8, ignore_eos=True)


async def _complete_counting_bytes(
    pd: Cluster, request_id: str, token_ids: list[int], sampling: SamplingParams
) -> tuple[list[int], int]:
    """Prefill then decode; returns the tokens and the KV bytes the decode acknowledged."""
    events = await pd.run_prefill(pd.request(request_id, token_ids, sampling))
    assert events.error is None, events.error
    assert events.kinds == ["first_token", "handed_off"], events.kinds
    handed_off = events.last("handed_off").handed_off
    ids, _ = await pd.generate(handed_off.lease_id)
    return [events.messages[0].first_token.token_id, *ids], handed_off.num_bytes


def _prompt_kv_bytes(pd: Cluster, num_tokens: int) -> int:
    layout = pd.prefill.loop.runner.kv_cache.layout
    return layout.num_layers * num_blocks_for(num_tokens, BLOCK_SIZE) * 2 * layout.block_nbytes


async def test_a_shared_prefix_is_computed_once_and_the_decode_gets_all_of_it(
    tiny_model_dir: Path, engine: LLMEngine, spans: InMemorySpanExporter
) -> None:
    async with cluster(tiny_model_dir) as pd:
        loop = pd.prefill.loop
        output, num_bytes = await _complete_counting_bytes(pd, "first", FIRST, GREEDY)
        assert output == engine.generate([FIRST], GREEDY)[0]
        assert loop.num_prompt_tokens == len(FIRST)
        with structlog.testing.capture_logs() as logs:
            output, num_bytes = await _complete_counting_bytes(pd, "second", SECOND, SEEDED)
        assert output == engine.generate([SECOND], SEEDED)[0]
        # Only the 5 tokens after the 3 cached blocks were computed, yet all 5 blocks shipped.
        assert loop.num_prompt_tokens == len(FIRST) + len(SECOND) - len(PREFIX)
        assert num_bytes == _prompt_kv_bytes(pd, len(SECOND))
        counters = {name: value for name, (_, value) in pd.prefill.counters().items()}
        assert counters["cached_prompt_tokens"] == len(PREFIX)
        assert counters["prefix_cache_hit_blocks"] == 3
        status = await pd.prefill_pool()
        assert status.pool.num_cached_blocks == 4  # the prefix and SECOND's fourth block
        assert status.pool.is_consistent, status.pool.detail
        await pd.assert_whole()
    first_token = next(e for e in logs if e["event"] == "first_token")
    assert first_token["num_cached_tokens"] == len(PREFIX)
    computes = [s for s in spans.get_finished_spans() if s.name == "prefill.compute"]
    cached = [dict(s.attributes or {}).get("pdserve.cached_tokens") for s in computes]
    assert cached == [0, len(PREFIX)]


async def test_without_the_prefix_cache_every_prompt_token_is_computed(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    async with cluster(tiny_model_dir, prefix_cache=False) as pd:
        for request_id, prompt in (("first", FIRST), ("second", SECOND)):
            reference = engine.generate([prompt], GREEDY)[0]
            assert await pd.complete(request_id, prompt, GREEDY) == reference
        assert pd.prefill.loop.num_prompt_tokens == len(FIRST) + len(SECOND)
        assert pd.prefill.counters()["cached_prompt_tokens"][1] == 0
        status = await pd.prefill_pool()
        assert status.pool.num_cached_blocks == 0
        assert status.load.HasField("max_cached_blocks") and status.load.max_cached_blocks == 0
        await pd.assert_whole()


async def test_a_prompt_of_whole_cached_blocks_computes_its_last_token(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    async with cluster(tiny_model_dir) as pd:
        reference = engine.generate([PREFIX], GREEDY)[0]
        assert await pd.complete("first", PREFIX, GREEDY) == reference
        output, num_bytes = await _complete_counting_bytes(pd, "again", PREFIX, GREEDY)
        assert output == reference
        assert pd.prefill.loop.num_prompt_tokens == len(PREFIX) + BLOCK_SIZE
        assert num_bytes == _prompt_kv_bytes(pd, len(PREFIX))
        await pd.assert_whole()


async def test_cached_blocks_are_evicted_under_pressure_without_a_leak(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # 12 prefill blocks; each prompt takes 6 (5 full), so every admission evicts cached blocks.
    prompts = [[(17 * i + 31 * j) % 290 + 3 for j in range(21)] for i in range(5)]
    prompts.append([*prompts[-1][:20], 250])  # shares the last prompt's 5 blocks
    async with cluster(tiny_model_dir, num_blocks=12) as pd:
        for i, prompt in enumerate(prompts):
            reference = engine.generate([prompt], sampling)[0]
            assert await pd.complete(f"r{i}", prompt, sampling) == reference
            status = await pd.prefill_pool()
            assert status.pool.is_consistent, status.pool.detail
            assert 0 < status.pool.num_cached_blocks <= 12
        assert pd.prefill.counters()["prefix_cache_hit_blocks"][1] == 5
        await pd.assert_whole()


async def test_a_bounded_prefix_cache_keeps_the_latest_prompts_and_forgets_older_ones(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    sampling = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # NOTE: three prompts of 5 full blocks and a token each; the cache keeps 5 freed blocks.
    prompts = [[(13 * i + 29 * j) % 290 + 3 for j in range(5 * BLOCK_SIZE + 1)] for i in range(3)]
    async with cluster(tiny_model_dir, prefix_cache_max_tokens=5 * BLOCK_SIZE + 3) as pd:
        for i, prompt in enumerate(prompts):
            assert (
                await pd.complete(f"r{i}", prompt, sampling)
                == engine.generate([prompt], sampling)[0]
            )
            status = await pd.prefill_pool()
            assert status.pool.is_consistent, status.pool.detail
            assert status.pool.num_cached_blocks == 5
        # NOTE: the load report tells a router how much of what it sent here is kept.
        assert status.load.HasField("max_cached_blocks") and status.load.max_cached_blocks == 5
        assert pd.prefill.counters()["prefix_cache_hit_blocks"][1] == 0
        for request_id, prompt, num_hits in (("latest", prompts[2], 5), ("oldest", prompts[0], 0)):
            before = pd.prefill.counters()["prefix_cache_hit_blocks"][1]
            assert (
                await pd.complete(request_id, prompt, sampling)
                == engine.generate([prompt], sampling)[0]
            )
            assert pd.prefill.counters()["prefix_cache_hit_blocks"][1] - before == num_hits
        await pd.assert_whole()
