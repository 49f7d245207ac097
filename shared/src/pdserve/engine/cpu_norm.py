"""pdserve's RMSNorm on the CPU (``shared/csrc/rms_norm.cpp``): bf16 rows normed in float32 in
one call, where `pdserve.engine.layers.RMSNorm` otherwise runs eight tensor ops (a float copy,
square, mean, add, rsqrt, multiply, a bf16 copy, the weight). The arithmetic is the layer's: the
normed values rounded to bf16 and then scaled by the bf16 weight (each product rounded), or
scaled in float32 and rounded once (gpt-oss); the sum of squares is float32 in the kernel's own
order, so a value can differ from torch's in its last bit. Each row alone: batch-invariant.
float32 rows (AVX2) likewise, one call where torch's float32 norm is a composite of several ops
(3.3 ms of a one-row float32 step of the default model).
"""

from __future__ import annotations

import torch

import pdserve.engine.cpu_kernels as cpu_kernels


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes the norm of `x` (contiguous bf16 or float32 rows on a CPU) by
    `weight` (the same dtype)."""
    is_f32 = x.dtype == torch.float32
    return (
        x.dtype in (torch.bfloat16, torch.float32)
        and weight.dtype == x.dtype
        and x.device.type == "cpu"
        and x.is_contiguous()
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[-1]
        and torch.get_num_threads() == 1
        and (cpu_kernels.f32_available() if is_f32 else cpu_kernels.available())
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, is_scaled_in_float32: bool
) -> torch.Tensor:
    """The RMSNorm of `x`'s rows (``[..., size]`` bf16 or float32) by `weight` (``[size]``, the
    same dtype; float32 has one order: scaled in float32)."""
    out = torch.empty_like(x)
    size = x.shape[-1]
    if x.dtype == torch.float32:
        rows = x.numel() // size
        compiled = cpu_kernels.compiled()
        compiled.rms_norm_f32(x.data_ptr(), rows, size, weight.data_ptr(), eps, out.data_ptr())
        return out
    cpu_kernels.compiled().rms_norm(
        x.data_ptr(),
        x.numel() // size,
        size,
        weight.data_ptr(),
        eps,
        is_scaled_in_float32,
        out.data_ptr(),
    )
    return out
