"""pdserve's int8 CPU kernel (``shared/csrc/int8_gemm.cpp``): int8 groups ``scale * q + min``
(16 or 32 input features a group, a float16 or float32 scale, an optional float32 min) times
bfloat16 activations on AVX512-BF16, with the file's values as they are: a GGUF's Q8_0 (groups
of 32, float16 scales), Q6_K (groups of 16, ``q - 32`` with the float32 ``d * sc``) and Q5_K
(groups of 32, float32 ``d * sc`` and mins ``-dmin * m``) map onto it exactly.

The engine runs the projections, the LM head (and reads the embedding it is tied to) on it
where the GGUF holds them so (`pdserve.engine.quant.Int8GroupLinear`): a Q8_0 LM head streams
30 MB a step on the default model instead of 57 MB of bf16. Each value becomes two bf16 words
whose sum it is (both exact), multiplied with VDPBF16PS (exact products, float32 sums), then
the group's float32 scale (plus its min times the sum of its inputs): each row's result
independent of the other rows of the call.

It runs where `pdserve.engine.int4_kernel` does: the CPU has AVX512-BF16, the compiled module
was built, activations are bfloat16 and torch runs one thread (`why_not` says why not); with
float32 activations, on ``f32_gemm.cpp``'s kernel where the CPU has AVX2, FMA and F16C (each
value widened to float32, FMA, the group's scale and min as here).
"""

from __future__ import annotations

import torch

import pdserve.engine.cpu_kernels as cpu_kernels

GROUP = 32
"""Input features the kernel walks at a time: in_features must be a multiple of it."""
GROUPS = (16, 32)
"""Input features per scale (and min) the kernel takes."""

available = cpu_kernels.available
_FIT = cpu_kernels.GemmFit(GROUP)
takes = _FIT.takes
why_not = _FIT.why_not


def group_of(values: torch.Tensor, scales: torch.Tensor) -> int:
    """Input features per scale (`GROUPS`) of a weight's `values` and `scales`.

    Raises:
        ValueError: Where the shapes, dtypes or group size do not fit the kernel.
    """
    num_out, num_in = values.shape
    num_groups = scales.shape[-1] if scales.dim() == 2 else 0
    group = num_in // num_groups if num_groups else 0
    if (
        values.dtype != torch.int8
        or scales.shape != (num_out, num_groups)
        or group not in GROUPS
        or group * num_groups != num_in
        or scales.dtype not in (torch.float16, torch.float32)
    ):
        raise ValueError(
            f"scales {tuple(scales.shape)} {scales.dtype} do not fit {values.dtype} values "
            f"{tuple(values.shape)} in groups of {GROUPS}"
        )
    return group


def _layout(
    values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None
) -> tuple[int, int, int, int]:
    """The kernel's (scales address, scales_f32, group, mins address or 0)."""
    group = group_of(values, scales)
    if mins is not None and (mins.shape != scales.shape or mins.dtype != torch.float32):
        raise ValueError(f"mins {tuple(mins.shape)} {mins.dtype} do not fit the scales")
    is_f32 = int(scales.dtype == torch.float32)
    return scales.data_ptr(), is_f32, group, 0 if mins is None else mins.data_ptr()


def matmul(
    x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T`` for ``w = scale * values + min``.

    Args:
        x: ``[rows, in]`` bfloat16 (AVX512-BF16) or float32 (AVX2).
        values: ``[out, in]`` int8, contiguous.
        scales: ``[out, in / group]`` float16 or float32, contiguous (group: 16 or 32).
        mins: ``[out, in / group]`` float32, contiguous, or None (no mins).

    Returns:
        ``[rows, out]`` in x's dtype.
    """
    x = x.contiguous()
    num_rows, num_in = x.shape
    num_out = values.shape[0]
    layout = _layout(values, scales, mins)
    out = torch.empty(num_rows, num_out, dtype=x.dtype)
    if num_rows:
        cpu_kernels.kernel("int8_gemm", x.dtype)(
            x.data_ptr(), num_rows, num_in, values.data_ptr(), *layout, num_out, out.data_ptr()
        )
    return out


def dequantize(
    values: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of the weight ``scale * values + min`` as bfloat16 (the product exact in float32,
    the sum rounded once, then once to bfloat16).

    Args:
        values: ``[out, in]`` int8, its rows contiguous (a slice of rows is fine).
        scales: ``[out, in / group]`` float16 or float32, likewise.
        mins: ``[out, in / group]`` float32, likewise, or None.
        ids: ``[n]`` row indices (checked against ``out`` here); every row when None.

    Returns:
        ``[n, in]`` (or ``[out, in]``) bfloat16.
    """
    num_out, num_in = values.shape
    layout = _layout(values, scales, mins)
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
            values.data_ptr(), *layout, num_in, ids_ptr, num_ids, out.data_ptr()
        )
    return out


def dequantize_torch(
    values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """`dequantize` in torch's ops, to any `dtype` (where the kernel does not run): the same
    float32 values, rounded once to `dtype`."""
    group = group_of(values, scales)
    weight = values.float() * scales.float().repeat_interleave(group, dim=-1)
    if mins is not None:
        weight += mins.float().repeat_interleave(group, dim=-1)
    return weight.to(dtype)
