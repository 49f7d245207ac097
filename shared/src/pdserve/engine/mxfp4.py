"""MXFP4 tensors of a safetensors checkpoint, as gpt-oss's released checkpoints hold their experts.

A weight ``<name>`` is stored as two tensors: ``<name>_blocks`` (uint8, ``[..., rows, cols / 32,
16]``: two 4-bit e2m1 codes a byte, the even element in the low nibble) and ``<name>_scales``
(uint8 e8m0, ``[..., rows, cols / 32]``: each block of 32 elements times ``2 ** (scale -
127)``). Every value is exact in bfloat16 and float32 (an e2m1 value has one mantissa bit, the
scale is a power of two), so the loader reads the pair as the weight it holds, in the model's
dtype: the checkpoint's own values, not an approximation of them. Stacked experts (``[experts,
rows, cols]``) come out as transformers' MXFP4 dequantization gives them, ``[experts, cols,
rows]``: the layout of the same checkpoint in bfloat16.
"""

from __future__ import annotations

import torch

from pdserve.engine.arch_config import ModelLoadError

BLOCKS = "_blocks"
SCALES = "_scales"
BLOCK_SIZE = 32
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
"""The value of each 4-bit e2m1 code."""


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight a blocks and scales pair holds, ``[..., rows, cols]`` in `dtype` (made one
    slice of the first dimension at a time: no float32 copy of a whole expert stack)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(
            f"MXFP4 blocks and scales are uint8, not {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK_SIZE // 2:
        raise ModelLoadError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    # NOTE: byte b -> its two values (the low nibble's first): one lookup per byte.
    pairs = torch.stack((values.repeat(16), values.repeat_interleave(16)), dim=-1)
    shape = (*scales.shape[:-1], scales.shape[-1] * BLOCK_SIZE)
    out = torch.empty(shape, dtype=dtype)
    flat_blocks, flat_scales = (
        blocks.reshape(-1, *blocks.shape[-3:]),
        scales.reshape(-1, *scales.shape[-2:]),
    )
    flat_out = out.view(-1, *shape[-2:])
    for index in range(flat_out.shape[0]):
        # weight: [rows, cols / 32, 32], times its block's power of two (exact)
        weight = pairs[flat_blocks[index].long()].flatten(-2)
        weight.mul_(torch.exp2(flat_scales[index].to(torch.float32) - 127)[..., None])
        flat_out[index].copy_(weight.flatten(-2))
    return out


class PackedPairs:
    """Joins each MXFP4 weight's two tensors as a checkpoint is read, one tensor at a time.

    Args:
        dtype: The dtype the weights are made in (the model's).

    Attributes:
        num_joined: MXFP4 weights read so far.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self._dtype = dtype
        self._halves: dict[str, tuple[str, torch.Tensor]] = {}
        self.num_joined = 0

    def join(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """`(name, tensor)` for a tensor that is no half of a pair; for a half, None until
        its other half is read, then the weight under its own name."""
        if name.endswith(BLOCKS):
            weight, suffix = name.removesuffix(BLOCKS), BLOCKS
        elif name.endswith(SCALES):
            weight, suffix = name.removesuffix(SCALES), SCALES
        else:
            return name, tensor
        other = self._halves.pop(weight, None)
        if other is None:
            self._halves[weight] = (suffix, tensor)
            return None
        blocks, scales = (tensor, other[1]) if suffix == BLOCKS else (other[1], tensor)
        joined = dequantize(blocks, scales, self._dtype)
        self.num_joined += 1
        return weight, joined.transpose(-1, -2) if joined.dim() == 3 else joined

    def check_done(self) -> None:
        """Raises for a half whose other half the checkpoint lacks.

        Raises:
            ModelLoadError: Naming it.
        """
        if self._halves:
            weight, (suffix, _) = next(iter(self._halves.items()))
            lacking = SCALES if suffix == BLOCKS else BLOCKS
            raise ModelLoadError(f"MXFP4 tensor {weight + suffix!r} has no {weight + lacking!r}")
