"""Weights a safetensors checkpoint stores as two tensors, joined as the checkpoint is read.

* **MXFP4**, as gpt-oss's released checkpoints hold their experts: a weight ``<name>`` is
  ``<name>_blocks`` (uint8, ``[..., rows, cols / 32, 16]``: two 4-bit e2m1 codes a byte, the
  even element in the low nibble) and ``<name>_scales`` (uint8 e8m0, ``[..., rows, cols / 32]``:
  each block of 32 elements times ``2 ** (scale - 127)``). Every value is exact in bfloat16 and
  float32 (an e2m1 value has one mantissa bit, the scale is a power of two): the weight is the
  checkpoint's own values. Stacked experts (``[experts, rows, cols]``) come out as
  transformers' MXFP4 dequantization gives them, ``[experts, cols, rows]``: the layout of the
  same checkpoint in bfloat16. Where the loader keeps them quantized instead
  (`pdserve.engine.moe.KeptExperts`), they come out as their codes and scales (`mxfp4_codes`).
* **Block FP8**, as DeepSeek-V3's, GLM-4.5-FP8's and Qwen3's FP8 checkpoints hold their
  projections (``quantization_config``: ``quant_method: fp8``, ``weight_block_size``): a weight
  ``<name>`` in float8 (e4m3) and ``<name>_scale_inv`` (float32, ``[ceil(rows / block rows),
  ceil(cols / block cols)]``), the weight being each value times its block's scale, computed
  in float32 as transformers and DeepSeek's reference do (the product of an e4m3 value and a
  float32 scale rounded once), then in the model's dtype.
* **Channel FP8**, as compressed-tensors writes FP8 checkpoints (``quant_method:
  compressed-tensors``, ``format: float-quantized``): a float8 ``<name>`` and its
  ``<name>_scale`` (float32, one per output row, ``[rows, 1]``, or one for the tensor), the
  weight being each value times its scale (in float32). A static scheme's ``input_scale`` is
  left out: the activations run in the model's dtype, unquantized.

Other quantization methods (GPTQ, AWQ, bitsandbytes, compressed-tensors' packed integers) are
refused at load, by name (`check_quantization`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pdserve.engine.arch_config import ModelLoadError

BLOCKS = "_blocks"
SCALES = "_scales"
SCALE_INV = "_scale_inv"
SCALE = "_scale"
INPUT_SCALE = ".input_scale"
MXFP4_BLOCK = 32
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = _E2M1_MAGNITUDES + tuple(-value for value in _E2M1_MAGNITUDES)
"""The value of each 4-bit e2m1 code."""
FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_FP8_BLOCK = (128, 128)
"""DeepSeek-V3's block, where a checkpoint's config does not say its own."""


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The weight an MXFP4 blocks and scales pair holds, ``[..., rows, cols]`` in `dtype` (made
    one slice of the first dimension at a time: no float32 copy of a whole expert stack)."""
    _check_mxfp4(blocks, scales)
    pairs = _byte_pairs(torch.tensor(E2M1_VALUES, dtype=torch.float32))
    shape = (*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK)
    out = torch.empty(shape, dtype=dtype)
    flat_blocks = blocks.reshape(-1, *blocks.shape[-3:])
    flat_scales = scales.reshape(-1, *scales.shape[-2:])
    flat_out = out.view(-1, *shape[-2:])
    for index in range(flat_out.shape[0]):
        # weight: [rows, cols / 32, 32], times its block's power of two (exact)
        weight = pairs[flat_blocks[index].long()].flatten(-2)
        weight.mul_(torch.exp2(flat_scales[index].to(torch.float32) - 127)[..., None])
        flat_out[index].copy_(weight.flatten(-2))
    return out


class Int8Pair(NamedTuple):
    """A packed weight as int8 groups (`Mxfp4Codes.as_int8`).

    Attributes:
        values: ``[..., rows, cols]`` int8.
        scales: ``[..., rows, cols / 32]`` float32.
    """

    values: torch.Tensor
    scales: torch.Tensor


class Mxfp4Codes(NamedTuple):
    """An MXFP4 weight kept as the checkpoint holds it, one 4-bit e2m1 code a value
    (`mxfp4_codes`): the weight is ``E2M1_VALUES[code] * scale``.

    Attributes:
        codes: ``[..., rows, cols]`` uint8 in 0..15.
        scales: ``[..., rows, cols / 32]`` float32, each block's ``2 ** (e8m0 - 127)``.
    """

    codes: torch.Tensor
    scales: torch.Tensor

    def as_int8(self) -> Int8Pair:
        """The same weight as int8 groups of `MXFP4_BLOCK`, each value exactly: the e2m1
        values times two (integers in -12..12) and the scales halved. Made one slice of the
        first dimension at a time: no index tensor over a whole expert stack."""
        doubled = torch.tensor([int(2 * v) for v in E2M1_VALUES], dtype=torch.int8)
        values = torch.empty(self.codes.shape, dtype=torch.int8)
        flat_codes = self.codes.reshape(-1, *self.codes.shape[-2:])
        flat_values = values.view(-1, *self.codes.shape[-2:])
        for index in range(flat_values.shape[0]):
            flat_values[index].copy_(doubled[flat_codes[index].long()])
        return Int8Pair(values, self.scales / 2)


def mxfp4_codes(blocks: torch.Tensor, scales: torch.Tensor) -> Mxfp4Codes:
    """An MXFP4 blocks and scales pair as one code a value, ``[..., rows, cols]``, the even
    element's code from the low nibble, and its scales as float32 powers of two (exact)."""
    _check_mxfp4(blocks, scales)
    packed = blocks.flatten(-2)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    return Mxfp4Codes(codes, torch.exp2(scales.to(torch.float32) - 127))


def mxfp4_as_int8(blocks: torch.Tensor, scales: torch.Tensor) -> Int8Pair:
    """The weight an MXFP4 blocks and scales pair holds as int8 groups of `MXFP4_BLOCK`, each
    value exactly (`Mxfp4Codes.as_int8`)."""
    return mxfp4_codes(blocks, scales).as_int8()


def _byte_pairs(values: torch.Tensor) -> torch.Tensor:
    """``[256, 2]``: byte b's two 4-bit codes as `values` (the low nibble's first), so that a
    stack of MXFP4 blocks decodes with one lookup per byte."""
    return torch.stack((values.repeat(16), values.repeat_interleave(16)), dim=-1)


def _check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(
            f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ModelLoadError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
        )


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The weight a block-FP8 weight and its scales hold, ``[..., rows, cols]`` in `dtype`."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if weight.dtype not in FP8_TYPES or tuple(scale_inv.shape[-2:]) != grid:
        raise ModelLoadError(
            f"an FP8 weight {tuple(weight.shape)} ({weight.dtype}) with blocks of {block} has "
            f"scales {grid}, not {tuple(scale_inv.shape)}"
        )
    # NOTE: the scales spread over the rows only; over the columns they broadcast through a
    # view of the weight in blocks (no second weight-sized tensor).
    scale = scale_inv.to(torch.float32).repeat_interleave(block[0], dim=-2)[..., :rows, :]
    out = weight.to(torch.float32)
    full, rest = divmod(cols, block[1])
    out[..., : full * block[1]].unflatten(-1, (full, block[1])).mul_(scale[..., :full, None])
    if rest:
        out[..., full * block[1] :].mul_(scale[..., full:])
    return out.to(dtype)


def dequantize_fp8_channels(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The weight a channel-FP8 weight and its scale hold (one scale per row, or one)."""
    rows = weight.shape[-2] if weight.dim() >= 2 else 1
    if weight.dtype not in FP8_TYPES or scale.numel() not in (1, rows):
        raise ModelLoadError(
            f"an FP8 weight {tuple(weight.shape)} ({weight.dtype}) has a scale of "
            f"{tuple(scale.shape)}, not one per row or one"
        )
    factor = scale.to(torch.float32)
    factor = factor.reshape(-1, 1) if scale.numel() > 1 else factor.reshape(())
    return (weight.to(torch.float32) * factor).to(dtype)


def check_quantization(config: dict[str, object]) -> None:
    """Refuses a checkpoint quantized in a form the loader does not read.

    Args:
        config: The checkpoint's ``config.json``.

    Raises:
        ModelLoadError: Naming the method (and its format) and what is read.
    """
    quantization = config.get("quantization_config")
    if not isinstance(quantization, dict):
        return
    method = quantization.get("quant_method")
    form = quantization.get("format")
    if method in ("fp8", "mxfp4") or (method == "compressed-tensors" and form == "float-quantized"):
        return
    named = f"{method} ({form})" if form else str(method)
    raise ModelLoadError(
        f"the checkpoint is quantized with {named}, which pdserve does not read; it reads block "
        "FP8 (fp8), MXFP4 (mxfp4) and compressed-tensors' float-quantized FP8, and any "
        "bfloat16, float16 or float32 checkpoint (or a GGUF file)"
    )


class PackedPairs:
    """Joins each packed weight's two tensors as a checkpoint is read, one tensor at a time.

    Args:
        dtype: The dtype the weights are made in (the model's).
        fp8_block: The block of an FP8 checkpoint's scales (rows, columns).
        keeps_codes: Whether an MXFP4 weight (by its checkpoint name) is kept as its codes
            (`Mxfp4Codes`, `mxfp4_codes`) rather than made in `dtype`.

    Attributes:
        num_joined: Packed weights read so far, by format (``mxfp4``, ``fp8``).
    """

    def __init__(
        self,
        dtype: torch.dtype,
        fp8_block: tuple[int, int] = DEFAULT_FP8_BLOCK,
        keeps_codes: Callable[[str], bool] = lambda name: False,
    ) -> None:
        self._dtype = dtype
        self._keeps_codes = keeps_codes
        self._fp8_block = fp8_block
        # weight name -> (the half's role, the tensor), until the other half is read
        self._halves: dict[str, tuple[str, torch.Tensor]] = {}
        self.num_joined: dict[str, int] = {}

    def join(
        self, name: str, tensor: torch.Tensor
    ) -> tuple[str, torch.Tensor] | tuple[str, Mxfp4Codes] | None:
        """`(name, tensor)` for a tensor that is no half of a pair; for a half, None until
        its other half is read, then the weight under its own name (its `Mxfp4Codes` where
        `keeps_codes` says so)."""
        if name.endswith(BLOCKS):
            weight, role = name.removesuffix(BLOCKS), BLOCKS
        elif name.endswith(SCALES):
            weight, role = name.removesuffix(SCALES), SCALES
        elif name.endswith(SCALE_INV):
            weight, role = name.removesuffix(SCALE_INV), SCALE_INV
        elif name.endswith(".weight" + SCALE):
            weight, role = name.removesuffix(SCALE), SCALE
        elif name.endswith(INPUT_SCALE):
            return None  # NOTE: the activations run unquantized
        elif tensor.dtype in FP8_TYPES:
            weight, role = name, ""
        else:
            return name, tensor
        other = self._halves.pop(weight, None)
        if other is None:
            self._halves[weight] = (role, tensor)
            return None
        halves = {role: tensor, other[0]: other[1]}
        if BLOCKS in halves and SCALES in halves and self._keeps_codes(weight):
            self._count("mxfp4 kept")
            return weight, mxfp4_codes(halves[BLOCKS], halves[SCALES])
        if BLOCKS in halves and SCALES in halves:
            joined = dequantize_mxfp4(halves[BLOCKS], halves[SCALES], self._dtype)
            self._count("mxfp4")
            return weight, joined.transpose(-1, -2) if joined.dim() == 3 else joined
        if "" in halves and SCALE_INV in halves:
            self._count("fp8")
            return weight, dequantize_fp8(
                halves[""], halves[SCALE_INV], self._fp8_block, self._dtype
            )
        if "" in halves and SCALE in halves:
            self._count("fp8")
            return weight, dequantize_fp8_channels(halves[""], halves[SCALE], self._dtype)
        raise ModelLoadError(f"{weight!r} has halves {sorted(halves)} that make no weight")

    def _count(self, kind: str) -> None:
        self.num_joined[kind] = self.num_joined.get(kind, 0) + 1

    def check_done(self) -> None:
        """Raises for a half whose other half the checkpoint lacks.

        Raises:
            ModelLoadError: Naming it.
        """
        if not self._halves:
            return
        weight, (role, _) = next(iter(self._halves.items()))
        if role == "":
            raise ModelLoadError(
                f"the float8 tensor {weight!r} has no scale ({weight + SCALE_INV!r} or "
                f"{weight + SCALE!r})"
            )
        lacking = {BLOCKS: SCALES, SCALES: BLOCKS, SCALE_INV: "", SCALE: ""}[role]
        raise ModelLoadError(f"packed tensor {weight + role!r} has no {weight + lacking!r}")
