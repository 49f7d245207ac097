"""Does `torch.compile` speed up the CPU decode step? Eager vs compiled, in the same run.

    python bench/decode_compile.py                  # SmolLM2, bfloat16, one thread

Three runners on the same prefilled streams: eager as the engine ships (oneDNN-packed
projections); eager with torch's GEMM; and `torch.compile(model.forward, dynamic=True)` with
inductor's weight freezing (it packs the projections for oneDNN itself; inductor cannot lower
the engine's own packed weights). Reported: warm-up time (compilation) and the median decode
step of 1 and of 8 rows per runner, the steps alternating between runners.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from common import cpu_description, write_results

from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model
from pdserve.engine.runner import ModelRunner

NUM_STREAMS, PROMPT_LEN, BLOCK_SIZE, BLOCKS_PER_STREAM = 8, 128, 16, 40


class Streams:
    """A runner with `NUM_STREAMS` prefilled prompts, advanced one token per decode step."""

    def __init__(self, model_dir: str, dtype: str, linear_backend: str) -> None:
        config = EngineConfig(
            model=model_dir,
            dtype=dtype,
            linear_backend=linear_backend,
            num_threads=1,
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_STREAMS * BLOCKS_PER_STREAM),
        )
        self.runner = ModelRunner.load(config)
        generator = torch.Generator().manual_seed(0)
        self.tables = [
            list(range(i * BLOCKS_PER_STREAM, (i + 1) * BLOCKS_PER_STREAM))
            for i in range(NUM_STREAMS)
        ]
        self.sequences = [
            torch.randint(100, 40000, (PROMPT_LEN,), generator=generator).tolist()
            for _ in range(NUM_STREAMS)
        ]
        for sequence, table in zip(self.sequences, self.tables, strict=True):
            self.runner.execute([ScheduledChunk(sequence, 0, table)])
        self.lengths = [PROMPT_LEN] * NUM_STREAMS

    def step(self, num_rows: int) -> float:
        """One decode step of the first `num_rows` streams; its process CPU seconds."""
        chunks = [
            ScheduledChunk([self.sequences[row][-1]], self.lengths[row], self.tables[row])
            for row in range(num_rows)
        ]
        for row in range(num_rows):
            self.lengths[row] += 1
        start = time.process_time()
        self.runner.execute(chunks)
        return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=15, help="measured steps per batch size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = str(resolve_model(args.model).path)
    runners = {
        "eager, oneDNN-packed (as shipped)": Streams(model_dir, args.dtype, "auto"),
        "eager, torch GEMM": Streams(model_dir, args.dtype, "torch"),
        "torch.compile, inductor freezing": Streams(model_dir, args.dtype, "torch"),
    }
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    compiled = runners["torch.compile, inductor freezing"].runner.model
    compiled.forward = torch.compile(compiled.forward, dynamic=True)  # type: ignore[method-assign]
    warmup_s: dict[str, float] = {}
    for name, streams in runners.items():
        start = time.perf_counter()
        for _ in range(4):
            streams.step(1)
            streams.step(NUM_STREAMS)
        warmup_s[name] = time.perf_counter() - start
    samples: dict[str, dict[int, list[float]]] = {n: {1: [], NUM_STREAMS: []} for n in runners}
    for _ in range(args.steps):
        for name, streams in runners.items():
            for num_rows in (1, NUM_STREAMS):
                samples[name][num_rows].append(streams.step(num_rows))
    cpu = cpu_description()
    print(f"\n{args.model}, {args.dtype}, one thread, CPU clock; {cpu['cpu']}\n")
    print(f"| runner | warm-up s | step, 1 row (ms) | step, {NUM_STREAMS} rows (ms) |")
    print("|---|---|---|---|")
    rows: list[dict[str, Any]] = []
    for name in runners:
        one = statistics.median(samples[name][1]) * 1e3
        many = statistics.median(samples[name][NUM_STREAMS]) * 1e3
        rows.append({"runner": name, "warmup_s": warmup_s[name], "step_1_ms": one})
        rows[-1][f"step_{NUM_STREAMS}_ms"] = many
        print(f"| {name} | {warmup_s[name]:.1f} | {one:.2f} | {many:.2f} |")
    path = write_results("decode_compile", {"config": {**vars(args), **cpu}, "rows": rows})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
