"""Sampling: reproducible per (seed, position), correct distributions, and stop rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from pdserve.engine import (
    FinishReason,
    LLMEngine,
    Request,
    RequestStatus,
    Sampler,
    SamplingParams,
    SamplingRow,
)

EngineFactory = Callable[..., LLMEngine]
PromptFactory = Callable[..., list[list[int]]]
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=40, ignore_eos=True)


def test_token_depends_only_on_seed_position_and_logits() -> None:
    sampler = Sampler()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 300, generator=generator)
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=100)
    rows = [SamplingRow(params, seed=i * 7, completion_index=i) for i in range(8)]
    together = sampler(logits, rows)
    alone = [sampler(logits[i : i + 1], [rows[i]])[0] for i in range(8)]
    reversed_batch = sampler(logits.flip(0), rows[::-1])[::-1]
    noise = torch.randn(5, 300, generator=generator)
    padded = sampler(torch.cat([noise, logits]), [SamplingRow(params, 99, 3)] * 5 + rows)[5:]
    assert together == alone == reversed_batch == padded
    assert sampler(logits, rows) == together  # a second call: no hidden state


def test_different_seeds_and_positions_differ() -> None:
    sampler = Sampler()
    logits = torch.zeros(1, 300)  # uniform: every draw is pure noise
    params = SamplingParams(temperature=1.0)
    draws = {
        seed: [sampler(logits, [SamplingRow(params, seed, i)])[0] for i in range(30)]
        for seed in (1, 2)
    }
    assert draws[1] != draws[2]
    assert len(set(draws[1])) > 20


def test_empirical_distribution_matches_softmax() -> None:
    sampler = Sampler()
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0)
    num_draws = 4000
    counts = torch.zeros(4)
    for index in range(num_draws):
        counts[sampler(logits, [SamplingRow(params, 5, index)])[0]] += 1
    torch.testing.assert_close(counts / num_draws, logits[0].softmax(0), atol=0.03, rtol=0)


def test_top_k_top_p_and_greedy_limits() -> None:
    sampler = Sampler()
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(3))
    top3 = set(logits[0].topk(3).indices.tolist())
    argmax = int(logits.argmax())
    for index in range(200):
        assert sampler(logits, [SamplingRow(SamplingParams(top_k=3), 1, index)])[0] in top3
        assert sampler(logits, [SamplingRow(SamplingParams(top_p=1e-4), 1, index)])[0] == argmax
        assert sampler(logits, [SamplingRow(SamplingParams(top_k=1), 1, index)])[0] == argmax
        assert sampler(logits, [SamplingRow(SamplingParams(temperature=0), 1, index)])[0] == argmax


def test_seeded_request_same_tokens_alone_in_a_batch_and_after_resume(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    prompt, *others = prompts(4, seed=21, min_len=8, max_len=40)
    alone = make_engine("llama3").generate([prompt], SEEDED)[0]
    other_params = [
        SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, max_tokens=33, ignore_eos=True),
    ]
    engine = make_engine("llama3", max_num_batched_tokens=24)
    batched = engine.generate(
        [*others[:2], prompt, others[2]], [*other_params[:2], SEEDED, other_params[2]]
    )
    assert batched[2] == alone
    # Resume in a fresh engine from the prompt and the first 15 tokens: the rest is identical.
    resumed_engine = make_engine("llama3")
    resumed_engine.add_request("r", prompt, SEEDED, output_token_ids=alone[:15])
    rest: list[int] = []
    while resumed_engine.has_unfinished_requests():
        for output in resumed_engine.step():
            rest.extend(output.new_token_ids)
    assert alone[:15] + rest == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=40, ignore_eos=True)
    assert make_engine("llama3").generate([prompt], other_seed)[0] != alone


def test_stop_token_ends_the_request_and_is_included(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    prompt = prompts(1, seed=30)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = make_engine("qwen2").generate([prompt], greedy)[0]
    stop_id = full[6]
    engine = make_engine("qwen2")
    stop_params = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=(stop_id,))
    engine.add_request("s", prompt, stop_params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens == full[: full.index(stop_id) + 1]
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.STOP
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_request_whose_filters_leave_no_token_ends_aborted(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    first, second = prompts(2, seed=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    alone = make_engine("qwen2").generate([second], greedy)[0]
    engine = make_engine("qwen2")
    engine.add_request("stuck", first, replace(greedy, allowed_token_ids=(5,), bad_words=((5,),)))
    engine.add_request("beside", second, greedy)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    stuck = [o for o in outputs if o.request_id == "stuck"]
    assert [t for o in stuck for t in o.new_token_ids] == []
    assert stuck[-1].finished and stuck[-1].finish_reason is FinishReason.ABORT
    assert [t for o in outputs if o.request_id == "beside" for t in o.new_token_ids] == alone
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_max_tokens_and_max_model_len_cap_the_output(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    prompt = prompts(1, seed=31, min_len=20, max_len=20)[0]
    engine = make_engine("llama3", max_model_len=30)
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
    assert final["a"].num_output_tokens == 4
    assert final["a"].finish_reason is FinishReason.LENGTH
    assert final["b"].num_output_tokens == 30 - len(prompt)
    assert final["b"].finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("c", list(range(3, 33)), SamplingParams())


def test_eos_stops_unless_ignored() -> None:
    eos = (2, 7)
    for ignore_eos, expected in ((False, RequestStatus.FINISHED_STOPPED), (True, None)):
        params = SamplingParams(max_tokens=10, ignore_eos=ignore_eos)
        request = Request("r", [5, 6], params, seed=0, eos_token_ids=eos)
        request.append_output_token(7)
        assert request.check_stop(max_model_len=100) is expected


def test_abort_frees_blocks(make_engine: EngineFactory, prompts: PromptFactory) -> None:
    engine = make_engine("llama3")
    for index, prompt in enumerate(prompts(3, seed=40)):
        engine.add_request(str(index), prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_pool.num_used_blocks > 0
    assert engine.abort("1") and not engine.abort("1")
    assert "1" not in engine.scheduler.requests
    for output in engine.step():
        assert output.request_id != "1"
    assert engine.abort("0") and engine.abort("2")
    assert not engine.has_unfinished_requests()
    engine.block_pool.check_integrity()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
