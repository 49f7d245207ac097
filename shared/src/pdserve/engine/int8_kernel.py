"""pdserve's int8 CPU kernel (``shared/csrc/int8_gemm.cpp``): a GGUF's Q8_0 groups, ``scale * q``
with an int8 ``q`` and a float16 scale per 32 input features, times bfloat16 activations on
AVX512-BF16, with the file's values as they are.

The engine runs an LM head (and reads the embedding it is tied to) on it where the GGUF holds
that tensor as Q8_0 (`pdserve.engine.quant.Int8GroupLinear`): 30 MB streamed a step on the
default model instead of 57 MB of bf16. Each value becomes two bf16 words whose sum it is (both
exact), multiplied with VDPBF16PS (exact products, float32 sums), then the group's float32
scale: each row's result independent of the other rows of the call.

It runs where `pdserve.engine.int4_kernel` does: the CPU has AVX512-BF16, the compiled module
was built, activations are bfloat16 and torch runs one thread (`why_not` says why not).
"""

from __future__ import annotations

import torch

import pdserve.engine.cpu_kernels as cpu_kernels

GROUP = 32
"""Input features per scale: in_features must be a multiple of it."""

available = cpu_kernels.available


def takes(in_features: int, dtype: torch.dtype) -> bool:
    """Whether the kernel takes a projection of `in_features` with `dtype` activations, on one
    torch thread."""
    return why_not(dtype, in_features) is None


def why_not(dtype: torch.dtype, in_features: int = GROUP) -> str | None:
    """Why the kernel does not take a projection (None where it does), for the logs."""
    unavailable = cpu_kernels.why_unavailable()
    if unavailable is not None:
        return unavailable
    if dtype != torch.bfloat16:
        return f"activations are {str(dtype).removeprefix('torch.')}, not bfloat16"
    if in_features % GROUP:
        return f"in_features {in_features} is not a multiple of {GROUP}"
    if torch.get_num_threads() != 1:
        return f"torch runs {torch.get_num_threads()} threads (the kernel runs one)"
    return None


def matmul(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``w = scale * values``.

    Args:
        x: ``[rows, in]`` bfloat16.
        values: ``[out, in]`` int8, contiguous.
        scales: ``[out, in / 32]`` float16, contiguous.

    Returns:
        ``[rows, out]`` bfloat16.
    """
    x = x.contiguous()
    num_rows, num_in = x.shape
    num_out = values.shape[0]
    out = torch.empty(num_rows, num_out, dtype=torch.bfloat16)
    if num_rows:
        cpu_kernels.compiled().int8_gemm(
            x.data_ptr(),
            num_rows,
            num_in,
            values.data_ptr(),
            scales.data_ptr(),
            num_out,
            out.data_ptr(),
        )
    return out


def dequantize(
    values: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of the weight ``scale * values`` as bfloat16 (exact in float32, rounded once).

    Args:
        values: ``[out, in]`` int8, its rows contiguous (a slice of rows is fine).
        scales: ``[out, in / 32]`` float16, likewise.
        ids: ``[n]`` row indices (checked against ``out`` here); every row when None.

    Returns:
        ``[n, in]`` (or ``[out, in]``) bfloat16.
    """
    num_out, num_in = values.shape
    if ids is None:
        num_ids, ids_ptr = num_out, 0
    else:
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_out):
            raise IndexError(f"row index out of range for {num_out} rows")
        num_ids, ids_ptr = ids.numel(), ids.data_ptr()
    out = torch.empty(num_ids, num_in, dtype=torch.bfloat16)
    if num_ids:
        cpu_kernels.compiled().int8_dequantize(
            values.data_ptr(), scales.data_ptr(), num_in, ids_ptr, num_ids, out.data_ptr()
        )
    return out


def dequantize_torch(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`dequantize` in torch's ops, to any `dtype` (where the kernel does not run)."""
    weight = values.float() * scales.float().repeat_interleave(GROUP, dim=-1)
    return weight.to(dtype)
