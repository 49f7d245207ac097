"""One-row time of the LM head's GEMM on each CPU kernel a Q8_0 head could run on.

    python bench/lm_head_kernels.py                 # SmolLM2's head: 576 -> 49,152

A GGUF's Q8_0 tensor (int8 values, one fp16 scale per 32) has no exact torch CPU kernel:
``_weight_int8pack_mm`` takes one scale per output channel. The candidates, each on random
weights of the head's shape with bf16 activations, one thread, rounds interleaved:

* ``bf16``: the values dequantized to bf16 (lossy: a Q8_0 value has up to 19 significant
  bits), oneDNN's packed GEMM, what the engine runs;
* ``int8_per_channel``: re-quantized to int8 with one scale per row (lossy), torch's kernel;
* ``int4_two_planes``: ``q = 16 * high + low`` as two int4 weights in groups of 32 (the file's
  values, but for the bf16 scales), two int4 kernel calls added;
* ``int4``: one int4 weight, for scale (what a Q4 head would cost).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import cpu_description, write_results

ROUNDS = 7
CALLS = 20


def kernels(num_in: int, num_out: int) -> dict[str, Callable[[torch.Tensor], Any]]:
    """Each candidate's one-row call on random weights of the shape."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(num_out, num_in, generator=generator, dtype=torch.bfloat16)
    packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    int8 = torch.randint(-127, 128, (num_out, num_in), generator=generator, dtype=torch.int8)
    int8_scales = torch.rand(num_out, generator=generator).to(torch.bfloat16)

    def int4_weight() -> tuple[torch.Tensor, torch.Tensor]:
        values = torch.randint(0, 16, (num_out, num_in), generator=generator, dtype=torch.int32)
        scale_zeros = torch.rand(num_in // 32, num_out, 2, generator=generator)
        packed = torch._convert_weight_to_int4pack_for_cpu(values, 2)
        return packed, scale_zeros.to(torch.bfloat16)

    high, low = int4_weight(), int4_weight()

    def int4_mm(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, weight[0], 32, weight[1])

    return {
        "bf16": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed_bf16, None, "none", [], ""),
        "int8_per_channel": lambda x: torch._weight_int8pack_mm(x, int8, int8_scales),
        "int4_two_planes": lambda x: int4_mm(x, high).add_(int4_mm(x, low)),
        "int4": lambda x: int4_mm(x, low),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-features", type=int, default=576)
    parser.add_argument("--out-features", type=int, default=49152)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']}; flags: {' '.join(cpu['flags'])}")
    calls = kernels(args.in_features, args.out_features)
    x = torch.randn(1, args.in_features, dtype=torch.bfloat16)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call(x)
    for _ in range(ROUNDS):
        for name, call in calls.items():
            start = time.process_time()
            for _ in range(CALLS):
                call(x)
            samples[name].append((time.process_time() - start) / CALLS)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"\nLM head {args.in_features} -> {args.out_features}, one row, bf16, CPU time\n")
    print("| kernel | ms | vs bf16 |")
    print("|---|---:|---:|")
    for name, value in medians.items():
        print(f"| {name} | {value * 1e3:.3f} | {medians['bf16'] / value:.2f}x |")
    path = write_results("lm_head_kernels", {"config": {**vars(args), **cpu}, "ms": medians})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
