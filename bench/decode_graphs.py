"""Decode steps replayed from graphs vs eager steps, on the same runner and cache, in the same run.

    python bench/decode_graphs.py --device cuda --dtype bfloat16      # on a GPU: CUDA graphs
    python bench/decode_graphs.py --device cpu --dtype float32 --quick # rehearsal: the stand-in

One runner with graphs captured for every bucket up to the largest batch size; its streams are
prefilled once, then each batch size takes decode steps alternating between the graph path and
the eager path (`runner.graphs` set aside), each step through to the greedy tokens on the host
(the one sync a step has). Reported per batch size: the median step of each path and the
ratio eager / graphs (above 1: graphs are faster). On CPU the "graphs" are the stand-in capture
(the same Python run again), so the ratio there says only what the buffer bookkeeping costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from common import write_results

from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model
from pdserve.engine.runner import ModelRunner

BLOCK_SIZE = 16


class Streams:
    """Prefilled sequences, each advanced by one greedy token per decode step it takes part in."""

    def __init__(self, runner: ModelRunner, num_streams: int, prompt_len: int, max_len: int):
        self.runner = runner
        blocks_per_stream = -(-max_len // BLOCK_SIZE)
        # NOTE: block 0 is left out: the capture wrote padding into it.
        self.tables = [
            list(range(1 + i * blocks_per_stream, 1 + (i + 1) * blocks_per_stream))
            for i in range(num_streams)
        ]
        generator = torch.Generator().manual_seed(0)
        vocab = runner.model_config.vocab_size
        self.tokens = [
            torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
            for _ in range(num_streams)
        ]
        for start in range(0, num_streams, 8):
            rows = range(start, min(num_streams, start + 8))
            runner.execute([ScheduledChunk(self.tokens[i], 0, self.tables[i]) for i in rows])

    def step(self, num_rows: int, is_graph: bool) -> float:
        """One decode step of the first `num_rows` streams through to its tokens; seconds."""
        runner = self.runner
        graphs = runner.graphs
        chunks = [
            ScheduledChunk(self.tokens[i][-1:], len(self.tokens[i]) - 1, self.tables[i])
            for i in range(num_rows)
        ]
        synchronize(runner.device)
        start = time.perf_counter()
        try:
            runner.graphs = graphs if is_graph else None
            next_tokens = runner.execute(chunks).argmax(-1).tolist()
        finally:
            runner.graphs = graphs
        elapsed = time.perf_counter() - start
        for i, token in enumerate(next_tokens):
            self.tokens[i].append(token)
        return elapsed


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per path and size")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="batch sizes 1 and 4, 4 steps")
    args = parser.parse_args()
    if args.quick:
        args.batch_sizes, args.steps, args.warmup, args.prompt_len = [1, 4], 4, 1, 32
    max_batch = max(args.batch_sizes)
    num_steps = 2 * (args.steps + args.warmup) * len(args.batch_sizes)
    max_len = args.prompt_len + num_steps + BLOCK_SIZE
    blocks_per_stream = -(-max_len // BLOCK_SIZE)
    config = EngineConfig(
        model=str(resolve_model(args.model).path),
        dtype=args.dtype,
        device=args.device,
        enforce_eager=True,  # NOTE: captured below, sized for this bench's contexts
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=1 + max_batch * blocks_per_stream),
    )
    runner = ModelRunner.load(config)
    started = time.perf_counter()
    if not runner.capture_graphs(max_batch, max_len):
        raise SystemExit("no graphs captured (see the cuda_graphs_skipped line)")
    capture_s = time.perf_counter() - started
    assert runner.graphs is not None
    streams = Streams(runner, max_batch, args.prompt_len, max_len)
    rows: list[dict[str, Any]] = []
    for num_rows in args.batch_sizes:
        samples: dict[bool, list[float]] = {True: [], False: []}
        for index in range(args.warmup + args.steps):
            for is_graph in (True, False):
                elapsed = streams.step(num_rows, is_graph)
                if index >= args.warmup:
                    samples[is_graph].append(elapsed)
        graph_ms = statistics.median(samples[True]) * 1e3
        eager_ms = statistics.median(samples[False]) * 1e3
        rows.append(
            {"batch_size": num_rows, "graph_ms": graph_ms, "eager_ms": eager_ms,
             "eager_over_graph": eager_ms / graph_ms}
        )  # fmt: skip
    capture = type(runner.graphs.capture_backend).__name__
    buckets = list(runner.graphs.buckets)
    print(f"\n{args.model}, {args.dtype}, {args.device}, attention={runner.attention_backend}, "
          f"capture={capture} ({capture_s:.1f} s, buckets {buckets})\n")  # fmt: skip
    print("| batch | graphs step (ms) | eager step (ms) | eager / graphs |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch_size']} | {row['graph_ms']:.2f} | {row['eager_ms']:.2f} "
              f"| {row['eager_over_graph']:.2f} |")  # fmt: skip
    summary = {
        "attention_backend": runner.attention_backend,
        "capture": capture,
        "capture_s": capture_s,
        "buckets": buckets,
        "rows": rows,
    }
    path = write_results("decode_graphs", {"config": vars(args), "summary": summary})
    print(f"\nresults: {path}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
