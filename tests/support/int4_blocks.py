"""Random int4 weights in a GGUF's form (values 0..15 in groups of 32 with a scale and a min),
for the tests of pdserve's int4 kernels."""

from __future__ import annotations

import torch


def random_int4_blocks(
    out_features: int, in_features: int, seed: int, half: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [out, in] in 0..15, scales, mins [out, in / 32] float32, float16-exact if `half`)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    shape = (out_features, in_features // 32)
    scales = torch.rand(shape, generator=generator) * 0.02 + 1e-3
    mins = -8 * scales + torch.randn(shape, generator=generator) * 1e-3
    if half:
        scales, mins = scales.half().float(), mins.half().float()
    return q, scales, mins
