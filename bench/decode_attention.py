"""Time of pdserve's decode attention alone (``shared/csrc/decode_attention.cpp``, through
``pdserve.engine.cpu_attention.decode``): one sequence's query over its paged K/V, the default
model's heads (9 query heads over 3 KV heads, head_dim 64), at a few lengths.

    python bench/decode_attention.py                    # bf16 where the CPU has AVX512-BF16
    python bench/decode_attention.py --dtype float32    # the AVX2 kernel

Random K/V (blocks of 16 tokens, the blocks in order), one thread, warm caches: each length is
called ``--calls`` times after a warm-up; the median of ``--rounds`` rounds' mean per call. A
decode step calls it once per layer (30 for SmolLM2-135M).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_description, write_results

from pdserve.engine import cpu_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def per_call_s(num_keys: int, dtype: torch.dtype, calls: int, rounds: int) -> float:
    num_blocks = -(-num_keys // BLOCK_SIZE)
    generator = torch.Generator().manual_seed(num_keys)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    q = torch.randn((1, NUM_HEADS, HEAD_DIM), generator=generator).to(dtype)
    tables = torch.arange(num_blocks, dtype=torch.int32).reshape(1, num_blocks)
    lens = torch.tensor([num_keys], dtype=torch.int32)
    if not cpu_attention.takes(q, k_cache, NUM_KV_HEADS):
        raise SystemExit(f"the compiled kernel does not take {dtype} on this CPU")

    def call() -> None:
        cpu_attention.decode(q, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, None, None)

    for _ in range(calls // 10 + 1):
        call()
    means = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        means.append((time.perf_counter() - started) / calls)
    return statistics.median(means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--keys", type=int, nargs="+", default=[1, 64, 400, 1000, 4000])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']}, torch capability {cpu['torch_cpu_capability']}")
    print(f"flags: {' '.join(cpu['flags'])}")
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"\n| keys | {args.dtype} us per call |\n|---:|---:|")
    for num_keys in args.keys:
        seconds = per_call_s(num_keys, dtype, args.calls, args.rounds)
        rows.append({"keys": num_keys, "us_per_call": round(seconds * 1e6, 2)})
        print(f"| {num_keys} | {seconds * 1e6:.1f} |")
    write_results("decode_attention", {"cpu": cpu, "dtype": args.dtype, "rows": rows})


if __name__ == "__main__":
    main()
