"""Time of pdserve's int8 GEMM alone (``shared/csrc/int8_gemm.cpp``) at one row on a 576 -> 1536
projection in each layout a GGUF's int8 types take, against oneDNN's bf16 GEMM (``F.linear``).

    python bench/int8_gemm.py

Layouts: Q8_0's (groups of 32, float16 scales), Q6_K's (groups of 16, float32 scales), Q5_K's
(groups of 32, float32 scales and mins); random values, one distinct weight per layer (30
layers: past the caches, so each call reads its weight from memory as a decode step does). A
pass calls every layer's weight once per setting, the settings' order alternating by round;
each call timed alone (wall clock, preallocated inputs); medians over layers and rounds, one
torch thread.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pdserve.engine import int8_kernel

IN_FEATURES, OUT_FEATURES = 576, 1536
LAYOUTS = {
    "Q8_0": (32, torch.float16, False),
    "Q6_K": (16, torch.float32, False),
    "Q5_K": (32, torch.float32, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, IN_FEATURES, generator=generator).to(torch.bfloat16)
    calls: dict[str, list[Callable[[], torch.Tensor]]] = {}
    for name, (group, scale_dtype, has_mins) in LAYOUTS.items():
        calls[name] = []
        for _ in range(args.layers):
            values = torch.randint(-32, 32, (OUT_FEATURES, IN_FEATURES), generator=generator)
            values = values.to(torch.int8)
            shape = (OUT_FEATURES, IN_FEATURES // group)
            scales = (torch.rand(shape, generator=generator) * 1e-3).to(scale_dtype)
            mins = -torch.rand(shape, generator=generator) * 1e-2 if has_mins else None
            calls[name].append(partial(int8_kernel.matmul, x, values, scales, mins))
    calls["bf16 F.linear"] = []
    for _ in range(args.layers):
        weight = torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator).to(torch.bfloat16)
        calls["bf16 F.linear"].append(partial(F.linear, x, weight))
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for round_index in range(args.rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            for call in calls[name]:
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    for name in names:
        print(f"{name:14s} {statistics.median(times[name]) * 1e6:7.1f} us (median, 1 row)")


if __name__ == "__main__":
    main()
