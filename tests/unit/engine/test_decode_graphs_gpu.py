"""Decode graphs on CUDA: replayed steps against eager steps on the default model (skipped
without a GPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import (
    CacheConfig,
    EngineConfig,
    ModelRunner,
    ScheduledChunk,
    SchedulerConfig,
)
from pdserve.engine.graphs.capture import CudaGraphCapture
from pdserve.engine.model_store import ResolvedModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 16
NUM_STEPS = 64


def cuda_runner(model: ResolvedModel, *, enforce_eager: bool, max_num_seqs: int) -> ModelRunner:
    config = EngineConfig(
        model=str(model.path),
        dtype="bfloat16",
        device="cuda",
        max_model_len=BLOCKS_PER_SEQ * BLOCK_SIZE,
        enforce_eager=enforce_eager,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=1 + max_num_seqs * BLOCKS_PER_SEQ),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
    )
    return ModelRunner.load(config)


def test_graph_replay_equals_eager_on_the_default_model(smollm2: ResolvedModel) -> None:
    eager = cuda_runner(smollm2, enforce_eager=True, max_num_seqs=8)
    graphs = cuda_runner(smollm2, enforce_eager=False, max_num_seqs=8)
    assert graphs.graphs is not None, "loading on CUDA captures decode graphs"
    assert isinstance(graphs.graphs.capture_backend, CudaGraphCapture)
    assert graphs.graphs.buckets == (1, 2, 4, 8)
    generator = torch.Generator().manual_seed(3)
    vocab = eager.model_config.vocab_size
    # five sequences of different lengths (a bucket of 8: three padding rows)
    tokens = [
        torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 17, 33, 2, 60)
    ]
    tables = [list(range(1 + i * BLOCKS_PER_SEQ, 1 + (i + 1) * BLOCKS_PER_SEQ)) for i in range(5)]
    for runner in (eager, graphs):
        runner.execute([ScheduledChunk(t, 0, b) for t, b in zip(tokens, tables, strict=True)])
    num_mismatches = 0
    for _ in range(NUM_STEPS):
        chunks = [
            ScheduledChunk(t[-1:], len(t) - 1, b) for t, b in zip(tokens, tables, strict=True)
        ]
        eager_logits = eager.execute(chunks)
        graph_logits = graphs.execute(chunks)
        torch.testing.assert_close(graph_logits, eager_logits, atol=0.25, rtol=0.05)
        expected = eager_logits.argmax(-1).tolist()
        num_mismatches += graph_logits.argmax(-1).tolist() != expected
        # NOTE: both continue from the eager tokens, so one near-tie cannot compound.
        for sequence, token in zip(tokens, expected, strict=True):
            sequence.append(token)
    assert graphs.graphs.num_replays == NUM_STEPS
    assert num_mismatches == 0
    # a prefill chunk and a mixed step still run eagerly beside the graphs
    mixed = [ScheduledChunk(tokens[0][-1:], len(tokens[0]) - 1, tables[0])]
    mixed.append(ScheduledChunk(tokens[1][-3:], len(tokens[1]) - 3, tables[1]))
    graphs.execute(mixed)
    assert graphs.graphs.num_replays == NUM_STEPS
