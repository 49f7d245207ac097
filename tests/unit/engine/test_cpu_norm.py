"""pdserve's RMSNorm on the CPU (`pdserve.engine.cpu_norm`) against the layer's torch ops.

The sum of squares is float32 in the kernel's own order, so a normed value may differ from
torch's in its last bit before rounding: nearly every output is torch's bit for bit, and none
is more than one bf16 step away.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import cpu_norm
from pdserve.engine.layers import RMSNorm


def _cpu_has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512_bf16" in cpuinfo.read_text()


pytestmark = pytest.mark.skipif(
    not _cpu_has_avx512_bf16(), reason="the kernel needs AVX512-BF16; torch's ops run here"
)


def _torch_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The layer's own torch ops (the kernel declines a non-contiguous input)."""
    wide = torch.empty(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    strided = wide[..., ::2]
    assert not cpu_norm.takes(strided, norm.weight)
    return norm(strided)


@pytest.mark.parametrize("is_scaled_in_float32", [False, True], ids=["llama", "gpt_oss"])
@pytest.mark.parametrize("size", [64, 576, 100])
def test_the_kernel_norms_as_the_layer_does(is_scaled_in_float32: bool, size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    norm = RMSNorm(size, 1e-5, is_scaled_in_float32)
    norm.weight.data = (torch.randn(size, generator=generator) * 0.5 + 1).to(torch.bfloat16)
    x = (torch.randn(7, size, generator=generator) * 3).to(torch.bfloat16)
    assert cpu_norm.takes(x, norm.weight)
    with torch.no_grad():
        ours, theirs = norm(x), _torch_norm(norm, x)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    assert (ours == theirs).float().mean() >= 0.98
    step = theirs.float().abs() * 2**-7 + 1e-30
    assert ((ours.float() - theirs.float()).abs() <= step).all()


def test_a_row_is_normed_alone() -> None:
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576).to(torch.bfloat16) + 0.5
    x = torch.randn(9, 576).to(torch.bfloat16)
    with torch.no_grad():
        whole = norm(x)
        for row in range(9):
            assert torch.equal(norm(x[row : row + 1]), whole[row : row + 1])
