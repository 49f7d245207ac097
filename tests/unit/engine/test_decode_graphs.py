"""Decode graphs on CPU: the bucket plan, the static buffers, and graph steps (a stand-in
capture that reruns the step on the same buffers) against eager steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.engine import CacheConfig, EngineConfig, ModelRunner, ScheduledChunk
from pdserve.engine.graphs.buckets import bucket_for, bucket_sizes
from pdserve.engine.graphs.buffers import StaticDecodeBuffers
from pdserve.engine.graphs.capture import StandInCapture

BLOCK_SIZE = 8
BLOCKS_PER_SEQ = 12


@pytest.mark.parametrize(
    ("max_num_seqs", "buckets"),
    [
        (1, (1,)),
        (3, (1, 2, 4)),
        (8, (1, 2, 4, 8)),
        (16, (1, 2, 4, 8, 16)),
        (20, (1, 2, 4, 8, 16, 20)),
        (64, (1, 2, 4, 8, 16, 32, 48, 64)),
        (100, (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100)),
    ],
)
def test_bucket_plan(max_num_seqs: int, buckets: tuple[int, ...]) -> None:
    assert bucket_sizes(max_num_seqs) == buckets


def test_a_batch_pads_to_the_smallest_bucket_that_holds_it() -> None:
    buckets = bucket_sizes(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 9, 16, 17, 33, 64, 65)] == [
        1, 4, 8, 16, 16, 32, 48, 64, None,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="max_num_seqs"):
        bucket_sizes(0)


def test_filling_copies_the_batch_into_the_first_rows_and_pads_the_rest() -> None:
    buffers = StaticDecodeBuffers(8, 4, BLOCK_SIZE, vocab_size=10, device=torch.device("cpu"))
    chunks = [ScheduledChunk([11], 9, [5, 6, 7]), ScheduledChunk([12], 0, [3])]
    buffers.fill(chunks, 4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 0, 0]
    assert buffers.positions[:4].tolist() == [9, 0, 0, 0]
    assert buffers.context_lens[:4].tolist() == [10, 1, 1, 1]
    # slot of position 9: block 6 (its second), offset 1; padding writes row 0's slot.
    assert buffers.slot_mapping[:4].tolist() == [6 * 8 + 1, 3 * 8, 49, 49]
    assert buffers.write_rows[:4].tolist() == [0, 1, 0, 0]
    assert buffers.block_table[:4].tolist() == [[5, 6, 0, 0], [3, 0, 0, 0], [0] * 4, [0] * 4]
    # a smaller batch next step leaves no row of the previous one inside its bucket.
    buffers.fill([ScheduledChunk([13], 20, [1, 2, 4])], 2)
    assert buffers.block_table[:2].tolist() == [[1, 2, 4, 0], [0] * 4]
    assert buffers.context_lens[:2].tolist() == [21, 1]
    assert not buffers.fits(ScheduledChunk([1], 32, [1] * 5))  # past the table width
    assert not buffers.fits(ScheduledChunk([1, 2], 0, [1]))  # a prefill chunk
    with pytest.raises(ValueError):
        buffers.fill(chunks, 1)


def load_runner(path: Path, num_blocks: int) -> ModelRunner:
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
    )
    return ModelRunner.load(config)


class Streams:
    """Sequences decoded greedily by two runners step by step: prompts join, others finish."""

    def __init__(self, eager: ModelRunner, graphs: ModelRunner) -> None:
        self.runners = (eager, graphs)
        self.tokens: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}
        self.next_id = 0

    def join(self, prompt: list[int]) -> None:
        # NOTE: block 0 stays unused: capturing wrote padding into it.
        seq_id = self.next_id
        self.next_id += 1
        table = list(range(1 + seq_id * BLOCKS_PER_SEQ, 1 + (seq_id + 1) * BLOCKS_PER_SEQ))
        self.tokens[seq_id], self.tables[seq_id] = list(prompt), table

    def step(self, prefill_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        chunks = []
        for seq_id, tokens in self.tokens.items():
            if seq_id in prefill_ids:
                chunks.append(ScheduledChunk(tokens, 0, self.tables[seq_id]))
            else:
                chunks.append(ScheduledChunk(tokens[-1:], len(tokens) - 1, self.tables[seq_id]))
        eager, graphs = (runner.execute(chunks) for runner in self.runners)
        for seq_id, token in zip(self.tokens, eager.argmax(-1).tolist(), strict=True):
            self.tokens[seq_id].append(token)
        return eager, graphs


@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_graph_steps_equal_eager_steps(
    checkpoint: Callable[[str], Path], prompts: Callable[..., list[list[int]]], name: str
) -> None:
    path = checkpoint(name)
    num_blocks = 1 + 12 * BLOCKS_PER_SEQ
    eager, graphs = load_runner(path, num_blocks), load_runner(path, num_blocks)
    capture = StandInCapture()
    assert graphs.capture_graphs(8, BLOCKS_PER_SEQ * BLOCK_SIZE, capture)
    assert graphs.graphs is not None and graphs.graphs.buckets == (1, 2, 4, 8)
    assert capture.num_captures == 4
    streams = Streams(eager, graphs)
    pool = iter(prompts(12, seed=5, min_len=3, max_len=30))
    # (new sequences, sequences that finish) per step: sizes 1, 3, 5, 8, then 9 (eager), 6, 2.
    plan = {0: (1, 0), 3: (2, 0), 6: (2, 0), 9: (3, 0), 12: (1, 0), 14: (0, 3), 17: (0, 4)}
    num_replays = 0
    for step_index in range(20):
        joins, ends = plan.get(step_index, (0, 0))
        for seq_id in list(streams.tokens)[:ends]:
            del streams.tokens[seq_id]
        new_ids = tuple(range(streams.next_id, streams.next_id + joins))
        for _ in range(joins):
            streams.join(next(pool))
        eager_logits, graph_logits = streams.step(prefill_ids=new_ids)
        torch.testing.assert_close(graph_logits, eager_logits, atol=1e-5, rtol=0)
        assert graph_logits.argmax(-1).tolist() == eager_logits.argmax(-1).tolist()
        is_graph_step = not new_ids and len(streams.tokens) <= 8
        num_replays += is_graph_step
        assert capture.num_replays == num_replays, step_index
    assert num_replays >= 10
    # the padding rows' writes left every block a sequence uses as the eager runner's.
    torch.testing.assert_close(
        graphs.kv_cache.kv[:, :, 1:], eager.kv_cache.kv[:, :, 1:], atol=1e-5, rtol=0
    )


def test_a_batch_above_the_largest_bucket_runs_eagerly(
    checkpoint: Callable[[str], Path], prompts: Callable[..., list[list[int]]]
) -> None:
    runner = load_runner(checkpoint("llama3"), 1 + 6 * BLOCKS_PER_SEQ)
    capture = StandInCapture()
    runner.capture_graphs(4, BLOCKS_PER_SEQ * BLOCK_SIZE, capture)
    tables = [list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ)) for i in range(6)]
    sequences = prompts(6, seed=9, min_len=4, max_len=12)
    runner.execute([ScheduledChunk(s, 0, t) for s, t in zip(sequences, tables, strict=True)])
    decodes = [ScheduledChunk([7], len(s), t) for s, t in zip(sequences, tables, strict=True)]
    runner.execute(decodes[:5])
    assert capture.num_replays == 0
    runner.execute(decodes[:4])
    assert capture.num_replays == 1


def test_enforce_eager_and_the_device_decide_whether_graphs_are_captured() -> None:
    assert EngineConfig(model="m", device="cuda").uses_graphs
    assert not EngineConfig(model="m", device="cuda", enforce_eager=True).uses_graphs
    assert not EngineConfig(model="m", device="cpu").uses_graphs
    assert not EngineConfig(model="m", device="cuda", tensor_parallel_size=2).uses_graphs


def test_an_eager_runner_captures_nothing(checkpoint: Callable[[str], Path]) -> None:
    runner = load_runner(checkpoint("llama3"), 1 + BLOCKS_PER_SEQ)
    assert runner.graphs is None
    logits = runner.execute([ScheduledChunk([5, 6, 7], 0, list(range(1, 1 + BLOCKS_PER_SEQ)))])
    assert logits.shape[0] == 1
