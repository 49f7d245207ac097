"""Preemption by recompute under a tiny KV budget, and prefix caching."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve.engine import LLMEngine, SamplingParams

EngineFactory = Callable[..., LLMEngine]
PromptFactory = Callable[..., list[list[int]]]


def workload(prompts: PromptFactory) -> tuple[list[list[int]], list[SamplingParams]]:
    batch = prompts(6, seed=50, min_len=10, max_len=40)
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=40, seed=12, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True),
        SamplingParams(temperature=0.6, top_p=0.8, seed=13, max_tokens=28, ignore_eos=True),
    ]
    return batch, params


def run_checked(
    engine: LLMEngine, batch: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    for index, (prompt, sp) in enumerate(zip(batch, params, strict=True)):
        engine.add_request(str(index), prompt, sp)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
    pool = engine.block_pool
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
        pool.check_integrity()
        running_blocks = sum(len(r.block_ids) for r in engine.scheduler.requests.values())
        assert pool.num_used_blocks <= running_blocks
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
    return [tokens[str(i)] for i in range(len(batch))]


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_tiny_budget_preempts_and_still_produces_the_same_tokens(
    enable_prefix_caching: bool, make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    batch, params = workload(prompts)
    roomy = make_engine("llama3", num_blocks=512, block_size=4)
    expected = run_checked(roomy, batch, params)
    assert roomy.scheduler.num_preemptions == 0
    tight = make_engine(
        "llama3", num_blocks=20, block_size=4, enable_prefix_caching=enable_prefix_caching
    )
    assert run_checked(tight, batch, params) == expected
    assert tight.scheduler.num_preemptions > 0
    assert [len(t) for t in expected] == [sp.max_tokens for sp in params]


def test_request_that_can_never_fit_is_rejected(make_engine: EngineFactory) -> None:
    engine = make_engine("llama3", num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="blocks"):
        engine.add_request("big", list(range(3, 20)), SamplingParams(max_tokens=10))
    assert not engine.has_unfinished_requests()


def test_prefix_cache_hit_skips_computed_blocks_and_keeps_tokens(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    shared = prompts(1, seed=60, min_len=40, max_len=40)[0]
    first, second = [*shared, 5, 6, 7], [*shared, 8, 9]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = make_engine("mistral").generate([first, second], greedy)
    engine = make_engine("mistral", enable_prefix_caching=True)
    assert engine.generate([first], greedy)[0] == expected[0]
    assert engine.block_pool.num_cached_blocks >= len(shared) // 16
    engine.add_request("second", second, greedy)
    scheduled = engine.scheduler.schedule()
    (item,) = scheduled.scheduled
    assert item.num_computed_tokens == 32  # two full blocks of the shared prefix were reused
    tokens = []
    for output in engine.execute(scheduled):
        tokens.extend(output.new_token_ids)
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.extend(output.new_token_ids)
    assert tokens == expected[1]
    engine.block_pool.check_integrity()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
