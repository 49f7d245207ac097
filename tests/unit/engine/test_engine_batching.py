"""Chunked prefill, mixed batches and block placement do not change results."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from pdserve.common.generation import num_blocks_for
from pdserve.engine import LLMEngine, SamplingParams, ScheduledChunk
from pdserve.engine.attention_metadata import DecodeGroup, split_decode_groups

EngineFactory = Callable[..., LLMEngine]
PromptFactory = Callable[..., list[list[int]]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def run_steps(engine: LLMEngine) -> tuple[dict[str, list[int]], list[list[tuple[str, int]]]]:
    """Steps to completion; returns tokens per request and (request, num_new_tokens) per step."""
    tokens: dict[str, list[int]] = {}
    steps = []
    while engine.has_unfinished_requests():
        scheduled = engine.scheduler.schedule()
        steps.append([(s.request.request_id, s.num_new_tokens) for s in scheduled.scheduled])
        for output in engine.execute(scheduled):
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        engine.block_pool.check_integrity()
    return tokens, steps


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 17])
def test_chunked_prefill_logits_equal_one_shot(
    chunk_size: int, make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    engine = make_engine("llama3")
    prompt = prompts(1, seed=2, min_len=45, max_len=45)[0]
    whole = engine.runner.execute([ScheduledChunk(prompt, 0, engine.block_pool.allocate(3))])[0]
    block_ids = engine.block_pool.allocate(3)
    for start in range(0, len(prompt), chunk_size):
        chunk = ScheduledChunk(prompt[start : start + chunk_size], start, block_ids)
        logits = engine.runner.execute([chunk])[0]
    torch.testing.assert_close(logits, whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("budget", [7, 16, 33])
def test_chunked_prefill_tokens_equal_one_shot(
    budget: int, arch: str, make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    batch = prompts(3, seed=4, min_len=20, max_len=50)
    expected = make_engine(arch).generate(batch, GREEDY)
    engine = make_engine(arch, max_num_batched_tokens=budget)
    for index, prompt in enumerate(batch):
        engine.add_request(str(index), prompt, GREEDY)
    tokens, steps = run_steps(engine)
    assert all(sum(n for _, n in step) <= budget for step in steps)
    assert any(n not in (1, len(batch[int(r)])) for step in steps for r, n in step), "no chunking"
    assert [tokens[str(i)] for i in range(len(batch))] == expected


def test_mixed_batch_equals_each_request_alone(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    batch = prompts(6, seed=8, min_len=3, max_len=60)
    lengths = (5, 30, 12, 1, 40, 20)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    alone = [make_engine("qwen2").generate([p], sp)[0] for p, sp in zip(batch, params, strict=True)]
    engine = make_engine("qwen2", max_num_batched_tokens=16)
    for index, (prompt, sp) in enumerate(zip(batch, params, strict=True)):
        engine.add_request(str(index), prompt, sp)
    tokens, steps = run_steps(engine)
    assert [tokens[str(i)] for i in range(len(batch))] == alone
    assert [len(t) for t in alone] == [sp.max_tokens for sp in params]
    mixed = [step for step in steps if {n == 1 for _, n in step} == {True, False}]
    assert mixed, "no step mixed decodes with prefill chunks"
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_shuffled_noncontiguous_blocks_give_identical_logits(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    engine = make_engine("mistral", num_blocks=64)
    first, second = prompts(2, seed=6, min_len=40, max_len=60)
    contiguous = [[0, 1, 2, 3], [4, 5, 6, 7]]
    shuffled = [[57, 3, 40, 22], [9, 63, 31, 14]]
    results = []
    for tables in (contiguous, shuffled):
        prefill = engine.runner.execute(
            [ScheduledChunk(first[:-1], 0, tables[0]), ScheduledChunk(second[:-1], 0, tables[1])]
        )
        decode = engine.runner.execute(
            [
                ScheduledChunk(first[-1:], len(first) - 1, tables[0]),
                ScheduledChunk(second[-1:], len(second) - 1, tables[1]),
            ]
        )
        results.append(torch.cat([prefill, decode]))
    torch.testing.assert_close(results[0], results[1], atol=0, rtol=0)


def test_engine_on_a_shuffled_free_queue_generates_the_same(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    batch = prompts(4, seed=10, min_len=20, max_len=50)
    expected = make_engine("llama_tied").generate(batch, GREEDY)
    engine = make_engine("llama_tied")
    pool = engine.block_pool
    block_ids = pool.allocate(pool.num_blocks)
    random.Random(0).shuffle(block_ids)
    pool.free(block_ids)
    assert engine.generate(batch, GREEDY) == expected
    pool.check_integrity()


def test_split_decode_groups_covers_all_and_splits_far_apart_lengths() -> None:
    assert split_decode_groups([], 16) == []
    similar = split_decode_groups([30, 33, 40, 47], 16)
    assert similar == [DecodeGroup(0, 4, 3)]
    apart = split_decode_groups([5, 17, 300, 310, 900], 16)
    assert [(g.start, g.end) for g in apart] == [(0, 2), (2, 4), (4, 5)]
    assert [g.num_blocks for g in apart] == [2, 20, 57]


def test_decodes_of_very_different_lengths_equal_each_alone(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    engine = make_engine("llama3", num_blocks=128)
    lengths = [400, 6, 210, 17, 200]
    sequences = [prompts(1, seed=80 + i, min_len=n, max_len=n)[0] for i, n in enumerate(lengths)]
    tables = [engine.block_pool.allocate(num_blocks_for(n, 16)) for n in lengths]
    for sequence, table in zip(sequences, tables, strict=True):
        engine.runner.execute([ScheduledChunk(sequence[:-1], 0, table)])
    decodes = [
        ScheduledChunk(s[-1:], len(s) - 1, t) for s, t in zip(sequences, tables, strict=True)
    ]
    together = engine.runner.execute(decodes)
    alone = torch.cat([engine.runner.execute([chunk]) for chunk in decodes])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=0)
    assert len(split_decode_groups(sorted(lengths), 16)) > 1
