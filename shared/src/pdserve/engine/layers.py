"""Norms and activations the model families share (Linear lives with the model)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import pdserve.engine.cpu_kernels as cpu_kernels
import pdserve.engine.cpu_norm as cpu_norm
from pdserve.engine.model_config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like the reference: the normed values
    rounded to the model dtype, then scaled (Llama), or scaled in float32 and rounded after
    (`is_scaled_in_float32`: gpt-oss)."""

    def __init__(self, hidden_size: int, eps: float, is_scaled_in_float32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.is_scaled_in_float32 = is_scaled_in_float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_norm.takes(x, self.weight):
            # NOTE: one call instead of eight tensor ops (61 norms a step on the default model).
            return cpu_norm.rms_norm(x, self.weight, self.eps, self.is_scaled_in_float32)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.is_scaled_in_float32:
            return (self.weight * h).to(x.dtype)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x * (1 + weight)``, all in float32, then cast back.

    NOTE: the checkpoint stores ``weight`` centred on zero; it is not folded into ``1 + weight``
    at load because the reference adds the one in float32 even for a bf16 model.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def make_norm(config: ModelConfig, size: int) -> nn.Module:
    """The RMSNorm of the config's family over the last dimension of ``size``."""
    if config.gemma_norms:
        return GemmaRMSNorm(size, config.rms_norm_eps)
    return RMSNorm(size, config.rms_norm_eps, config.is_norm_scaled_in_float32)


def takes_silu_mul(gate_up: torch.Tensor) -> bool:
    """Whether `silu_mul` takes `gate_up`: contiguous float32 rows on a CPU with AVX2, or bf16
    rows (a multiple of 32 wide) on one with AVX512-BF16."""
    is_f32 = gate_up.dtype == torch.float32
    return (
        (is_f32 or (gate_up.dtype == torch.bfloat16 and gate_up.shape[-1] % 32 == 0))
        and gate_up.device.type == "cpu"
        and gate_up.dim() == 2
        and gate_up.is_contiguous()
        and torch.get_num_threads() == 1
        and (cpu_kernels.f32_available() if is_f32 else cpu_kernels.available())
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of each row ``[gate | up]`` of `gate_up` (``[rows, 2 * size]``):
    ``[rows, size]``, the fused decode step's arithmetic
    (`pdserve.engine.fused_decode`). In bf16 torch's two roundings: the SiLU computed in
    float32 and rounded, then the product rounded."""
    rows, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, size, dtype=gate_up.dtype)
    if rows:
        kernel = cpu_kernels.kernel("silu_mul", gate_up.dtype)
        kernel(gate_up.data_ptr(), rows, size, out.data_ptr())
    return out


def gated_activation(name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up``: SwiGLU for ``silu``, GeGLU for ``gelu_pytorch_tanh``."""
    if name == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up
