"""pdserve's AMX GEMM (``shared/csrc/amx_gemm.cpp``): bf16 activations times a packed int4
weight (`pdserve.engine.int4_kernel`'s) on AMX tiles, every output element summed over the
inputs in one order whatever the rows of the call: batch-invariant numerics
(`pdserve.engine.batch_invariant`) for an int4 projection at AMX's speed.

pdserve's int4 kernel gives a row the same bits for any number of rows, but it is written for
the few rows of a decode step (AVX512-BF16, one thread), so under ``--deterministic``, where it
ran every prefill row too, a 512-token prompt of the default model took 8x its fast-path time
on a CPU with AMX. This kernel dequantizes 32 output rows of the weight at a time (``s * q +
m``, rounded once to bf16, in the packed bytes' own order, the activations laid out to match)
and accumulates each 16 x 16 tile of the output over the inputs 32 at a time, in order, so a
row's result depends only on itself: a one-row decode step and a 512-row prefill compute a
token alike, and a call still reads the int4 weight once. On SmolLM2's 1536 x 576 projection,
one thread: 705-1,650 us for 512 rows against the int4 kernel's 12,082-12,761 us, and 113-157
us for one row against its 36-43 us, the price a lone decode stream pays (`docs/BENCHMARKS.md`).

It runs where the CPU has AMX-TILE and AMX-BF16, Linux grants the process the tiles' state, the
compiled module was built, the activations are bfloat16, the weight has no code table, and in
and out features are multiples of 64 and 32 (`takes`); `pdserve.engine.int4_kernel.matmul`
calls it with ``fixed_order``.
"""

from __future__ import annotations

import functools

import torch

import pdserve.engine.cpu_kernels as cpu_kernels


@functools.cache
def available() -> bool:
    """Whether the compiled module runs its AMX GEMM on this CPU, in this process."""
    return cpu_kernels.available() and bool(cpu_kernels.compiled().amx_supported())


def takes(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes an int4 projection of this shape with `dtype` activations."""
    return (
        dtype == torch.bfloat16 and out_features % 32 == 0 and in_features % 64 == 0 and available()
    )
