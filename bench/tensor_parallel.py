"""Tensor parallelism on CPU: a decode step split over ranks vs one process, and what moving
KV between different tensor-parallel sizes costs with and without a head remapping.

    .venv/bin/python bench/tensor_parallel.py                      # TP 1 vs 2, 8 streams
    .venv/bin/python bench/tensor_parallel.py --sizes 1 2 4 --num-streams 16 --json

Decode step: a random Llama (`common.build_random_llama`, 8 query and 4 KV heads) is loaded
at each size (one intra-op thread per rank); ``--num-streams`` sequences of ``--prompt-len``
tokens are prefilled, then ``--num-steps`` batched decode steps are timed one by one. The
median per size and its ratio to size 1 (measured in the same run) are printed.

KV transfer: the blocks of one sequence (``--kv-tokens`` tokens, every layer) are exported
from one cache and imported into another, as a sender and a receiver do. Without remapping is
what pdserve does (rank 0's cache holds every head, whatever the sizes); with remapping adds
what per-rank caches would need between sizes 2 and 1: the sender gathers each layer's blocks
from two head slices into whole blocks, the receiver scatters whole blocks into two slices.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import build_random_llama, write_results

from pdserve.engine import CacheConfig, EngineConfig, ScheduledChunk
from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.engine.load_runner import load_runner
from pdserve.engine.parallel.shared_cache import head_slice

BLOCK_SIZE = 16


def decode_step_ms(model_dir: Path, size: int, args: argparse.Namespace) -> list[float]:
    """Per-step milliseconds of `args.num_steps` batched decode steps at tensor-parallel `size`."""
    blocks_per_seq = (args.prompt_len + args.num_steps) // BLOCK_SIZE + 1
    config = EngineConfig(
        model=str(model_dir),
        tensor_parallel_size=size,
        num_threads=1,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=args.num_streams * blocks_per_seq),
    )
    runner = load_runner(config)
    try:
        tables = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            for i in range(args.num_streams)
        ]
        prompt = [(7 * j) % 1000 + 3 for j in range(args.prompt_len)]
        for table in tables:
            runner.execute([ScheduledChunk(prompt, 0, table)])
        times = []
        for step in range(args.num_steps):
            position = args.prompt_len + step
            chunks = [ScheduledChunk([5], position, table) for table in tables]
            started = time.perf_counter()
            runner.execute(chunks)
            times.append((time.perf_counter() - started) * 1000)
        return times
    finally:
        runner.close()


def transfer_ms(args: argparse.Namespace, remap: bool) -> list[float]:
    """Milliseconds to export one sequence's blocks from a cache and import them into another."""
    layout = KVCacheLayout(
        num_layers=args.num_layers, num_kv_heads=4, head_dim=64, block_size=BLOCK_SIZE,
        dtype="float32",
    )  # fmt: skip
    num_blocks = args.kv_tokens // BLOCK_SIZE
    source = KVCache(layout, num_blocks, torch.device("cpu"))
    target = KVCache(layout, num_blocks, torch.device("cpu"))
    staged = KVCache(layout, num_blocks, torch.device("cpu"))
    source.kv.normal_()
    halves = (range(0, 2), range(2, 4))
    source_slices = [head_slice(source, heads) for heads in halves]
    target_slices = [head_slice(target, heads) for heads in halves]
    block_ids = list(range(num_blocks))
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for layer in range(layout.num_layers):
            if remap:
                # whole: [2, num_blocks, block_size, num_kv_heads, head_dim] from two slices
                whole = torch.cat([s.kv[layer] for s in source_slices], dim=3)
                staged.kv[layer].copy_(whole)  # the transfer of whole blocks, as below
                for heads, part in zip(halves, target_slices, strict=True):
                    part.kv[layer].copy_(staged.kv[layer][:, :, :, heads.start : heads.stop])
            else:
                data = source.export_blocks(layer, block_ids)
                target.import_blocks(layer, block_ids, data.k, data.v)
        times.append((time.perf_counter() - started) * 1000)
    assert torch.equal(source.kv, target.kv)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-streams", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--num-steps", type=int, default=30)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--kv-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model-dir", type=Path, help="where the random model is written")
    parser.add_argument("--json", action="store_true", help="also write bench/results/*.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_llama(
            args.model_dir or Path(tmp) / "model",
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
        )
        run(model_dir, args)


def run(model_dir: Path, args: argparse.Namespace) -> None:
    """Measures both parts and prints (and with ``--json`` writes) the results."""
    rows = []
    baseline: float | None = None
    for size in args.sizes:
        median = statistics.median(decode_step_ms(model_dir, size, args))
        baseline = baseline if baseline is not None else median
        rows.append({"tensor_parallel_size": size, "step_ms": median, "ratio": median / baseline})
    print(f"decode step, {args.num_streams} streams at ~{args.prompt_len} tokens (median)")
    print(f"{'size':>6} {'step ms':>10} {'vs first':>10}")
    for row in rows:
        print(f"{row['tensor_parallel_size']:>6} {row['step_ms']:>10.2f} {row['ratio']:>9.2f}x")
    plain = statistics.median(transfer_ms(args, remap=False))
    remapped = statistics.median(transfer_ms(args, remap=True))
    print(f"KV of {args.kv_tokens} tokens x {args.num_layers} layers, export + import (median)")
    print(f"  whole blocks (pdserve): {plain:8.2f} ms")
    print(f"  head remap 2 <-> 1:     {remapped:8.2f} ms  ({remapped / plain:.2f}x)")
    if args.json:
        results = {"decode": rows, "transfer_ms": {"whole": plain, "remapped": remapped}}
        settings = {key: str(value) for key, value in vars(args).items()}
        print("results:", write_results("tensor_parallel", {**results, "args": settings}))


if __name__ == "__main__":
    main()
