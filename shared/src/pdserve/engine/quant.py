"""Weight-only quantization of the projections for CPU serving (``--quantization``).

The activations stay in the model dtype; each projection's weight is stored in int8 (one
scale per output channel, symmetric) or int4 (groups of `INT4_GROUP_SIZE` input features, a
scale and a zero each), and torch's CPU kernels (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``) dequantize it on the fly inside the GEMM. The LM head (the
tied embedding in small models) stays in the model dtype: it is the projection most sensitive
to rounding.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import pdserve.engine.amx_gemm as amx_gemm
import pdserve.engine.int4_kernel as int4_kernel
import pdserve.engine.int8_kernel as int8_kernel
from pdserve.engine.linear import (
    Linear,
    at_least_rows,
    can_pack_for_onednn,
    invariant_rows,
    onednn_linear,
)

INT4_GROUP_SIZE = 32
"""Input features sharing one int4 scale and zero (torch's kernel takes 32 to 256)."""
INT8_KERNEL_MAX_ROWS = 15
"""Most rows `Int8Linear` runs through torch's int8 kernel (bf16/fp16); more take a bf16 GEMM."""
OWN_KERNEL_MAX_ROWS = 8
"""Most rows pdserve's int4 kernel multiplies directly; more take a bf16 GEMM over the weight
dequantized for the call (measured on a 3072 x 576 projection, one thread: 8 rows 0.22 ms
either way, 16 rows 0.43 against 0.35 ms)."""
INT8_GROUP_CHUNK = 4096
"""Output rows `Int8GroupLinear` dequantizes at a time for a GEMM of many rows (a bf16 chunk of
an LM head stays in the caches; the whole of it would be a fresh 57 MB a call)."""
_INT4_INNER_K_TILES = 2
_INT4_OUT_MULTIPLE = 16


class Int8Linear(nn.Module):
    """`Linear` with an int8 ``[out, in]`` weight and a scale per output channel.

    NOTE: torch's int8 kernel dequantizes inside a GEMM that is fast for a few rows in bf16
    (a decode step of one row: 1.1-1.2x bf16's) but 2.6-3.2x slower than a bf16 GEMM at 16 to
    256 rows, and slow in float32 at any size. Past `INT8_KERNEL_MAX_ROWS` rows, and in
    float32, the weight is converted to the activation dtype (exact: int8 fits bf16's
    mantissa) for one GEMM and the output scaled:
    ``x @ (values * scales).T == (x @ values.T) * scales``.

    Args:
        linear: The projection to quantize (its weight is read, not kept).
    """

    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, linear: Linear) -> None:
        super().__init__()
        weight_t = linear.weight_t.detach()
        self.in_features, self.out_features = weight_t.shape
        weight, scales = quantize_int8(weight_t.t(), weight_t.dtype)
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.bias = linear.bias
        self.min_rows = 1
        """Fewer rows run padded to this many; above one (`pdserve.engine.batch_invariant`)
        every call takes the GEMM, `INVARIANT_MAX_ROWS` rows at a time (`invariant_rows`),
        whose result for a row does not depend on the row count (oneDNN's where it runs the
        dtype: MKL's float32 GEMM sums two or three rows in another order than more)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        if self.min_rows > 1:
            weight = self.weight.to(x.dtype)
            gemm = onednn_linear if can_pack_for_onednn(x.device, x.dtype) else F.linear
            out = invariant_rows(lambda rows: gemm(rows, weight), x, self.min_rows)
            out = out.mul_(self.scales)
        elif x.shape[0] <= INT8_KERNEL_MAX_ROWS and x.dtype != torch.float32:
            out = torch._weight_int8pack_mm(x, self.weight, self.scales)
        else:
            out = F.linear(x, self.weight.to(x.dtype)).mul_(self.scales)
        return out if self.bias is None else out.add_(self.bias)


class Int4Linear(nn.Module):
    """`Linear` with int4 weights ``scale * q + min``, a scale and a min per group of
    `INT4_GROUP_SIZE` input features, on one of two kernels:

    * pdserve's (`pdserve.engine.int4_kernel`), where it runs (AVX512-BF16 with bf16
      activations, or AVX2 with float32 ones; one torch thread): the scales and mins as given
      (float16 where that holds them exactly), so the weights are the file's own; up to
      `OWN_KERNEL_MAX_ROWS` rows it multiplies the int4 values directly, more rows take one
      GEMM over the weight dequantized for the call (a prefill: compute-bound, where oneDNN's
      GEMM is 2x either int4 kernel);
    * torch's (``_weight_int4pack_mm_for_cpu``) elsewhere, in its tile layout, with its scales
      and zeros in the activation dtype.

    Build one with `from_linear` (quantize a float weight) or `from_blocks` (values, scales and
    mins as a GGUF file stores them, `pdserve.engine.gguf_int4`).

    Args:
        q: ``[out, in]`` integers in 0..15.
        scales: ``[out, in / group_size]`` float32.
        mins: ``[out, in / group_size]`` float32.
        bias: ``[out]`` or None.
        dtype: The activation dtype.
    """

    packed: torch.Tensor
    scales: torch.Tensor | None
    mins: torch.Tensor | None
    scale_zeros: torch.Tensor | None

    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: nn.Parameter | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group_size = INT4_GROUP_SIZE
        self.min_rows = 1
        """Fewer rows run padded to this many (`pdserve.engine.batch_invariant`); above one,
        pdserve's kernel runs every row count (its rows are independent of each other)."""
        self.kernel = "pdserve" if int4_kernel.takes(self.in_features, dtype) else "torch"
        """Which kernel runs: ``pdserve`` or ``torch``."""
        if self.kernel == "pdserve":
            scale_dtype = int4_kernel.scale_dtype(scales, mins)
            # packed: [out, in / 2] uint8 in the kernel's order
            self.register_buffer("packed", int4_kernel.pack(q))
            self.register_buffer("scales", scales.to(scale_dtype).contiguous())
            # mins: [in / group_size, out], as the kernel reads them
            self.register_buffer("mins", mins.t().to(scale_dtype).contiguous())
            self.register_buffer("scale_zeros", None)
        else:
            # packed: [out, in / 2] uint8, two 4-bit values a byte in torch's tile order
            packed = torch._convert_weight_to_int4pack_for_cpu(
                q.to(torch.int32), _INT4_INNER_K_TILES
            )
            self.register_buffer("packed", packed)
            self.register_buffer("scales", None)
            self.register_buffer("mins", None)
            self.register_buffer("scale_zeros", _torch_scale_zeros(q, scales, mins, dtype))
        self.bias = bias
        self.is_fixed_order = False
        """Whether every bf16 call runs on the AMX GEMM of one summation order
        (`use_fixed_order_gemm`)."""

    def use_fixed_order_gemm(self) -> bool:
        """Runs every bf16 call from now on on the AMX GEMM whose sums run in one order for any
        number of rows (`pdserve.engine.amx_gemm`), where it takes the shape; returns whether it
        does."""
        self.is_fixed_order = self.kernel == "pdserve" and amx_gemm.takes(
            self.out_features, self.in_features, torch.bfloat16
        )
        return self.is_fixed_order

    @classmethod
    def from_linear(cls, linear: Linear) -> Int4Linear:
        """Quantizes `linear` (see `can_quantize_int4` for the shapes the kernel takes)."""
        weight_t = linear.weight_t.detach()
        values, scale_zeros = quantize_int4(weight_t.t(), INT4_GROUP_SIZE, weight_t.dtype)
        scales = scale_zeros[..., 0].t().float()
        mins = scale_zeros[..., 1].t().float() - 8 * scales
        return cls(values, scales, mins, linear.bias, weight_t.dtype)

    @classmethod
    def from_blocks(
        cls,
        values: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: nn.Parameter | None,
        dtype: torch.dtype,
    ) -> Int4Linear:
        """Takes a weight ``scale * q + min`` in groups of `INT4_GROUP_SIZE` as it is.

        Args:
            values: ``[out, in / 2]`` uint8, column ``2i`` in the low nibble, ``2i + 1`` high.
            scales: ``[out, in / group]`` float32.
            mins: ``[out, in / group]`` float32.
            bias: ``[out]`` or None.
            dtype: The activation dtype.
        """
        # q: [out, in] uint8 in 0..15
        return cls(int4_kernel.unpack_nibbles(values), scales, mins, bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        if self.kernel == "pdserve":
            assert self.scales is not None and self.mins is not None
            if self.is_fixed_order and x.dtype == torch.bfloat16:
                out = int4_kernel.matmul(x, self.packed, self.scales, self.mins, fixed_order=True)
                return out if self.bias is None else out.add_(self.bias)
            if x.shape[0] > OWN_KERNEL_MAX_ROWS and self.min_rows == 1:
                weight = int4_kernel.dequantize(self.packed, self.scales, self.mins, x.dtype)
                out = F.linear(x, weight)
            else:
                out = int4_kernel.matmul(x, self.packed, self.scales, self.mins)
            return out if self.bias is None else out.add_(self.bias)
        assert self.scale_zeros is not None
        rows = x.shape[0]
        x = at_least_rows(x, self.min_rows)
        out = torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scale_zeros)
        out = out[:rows]
        return out if self.bias is None else out.add_(self.bias)


class Int8Groups(nn.Module):
    """A module over an int8 matrix in groups, ``scale * value + min``, held as buffers:
    what `Int8GroupLinear` and `Int8GroupEmbedding` share.

    Args:
        values: ``[rows, cols]`` int8.
        scales: ``[rows, cols / group]`` float16 or float32.
        dtype: The activation dtype (the embedding's: of the rows it returns).
        mins: ``[rows, cols / group]`` (kept as float32), or None.
    """

    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        dtype: torch.dtype,
        mins: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.group_size = int8_kernel.group_of(values, scales)
        """Input features per scale (`int8_kernel.group_of` checks the shapes)."""
        self.register_buffer("values", values.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.register_buffer("mins", None if mins is None else mins.float().contiguous())
        self.dtype = dtype
        self.kernel = "pdserve" if int8_kernel.takes(values.shape[1], dtype) else "torch"
        """Which kernel runs: ``pdserve`` or ``torch`` (over the dequantized weight)."""


class Int8GroupLinear(Int8Groups):
    """A projection with int8 weights ``scale * q + min`` in groups of 16 or 32 input features:
    a float16 or float32 scale per group, optionally a float32 min (a GGUF's Q8_0, Q6_K and Q5_K
    as the file stores them, `pdserve.engine.gguf_int4`; the engine's projections and LM head
    where the file holds them so, `pdserve.engine.int4_weights`).

    Up to `OWN_KERNEL_MAX_ROWS` rows run on pdserve's int8 kernel
    (`pdserve.engine.int8_kernel`, where it runs: AVX512-BF16, bf16 activations, one torch
    thread); more rows, and every call where the kernel does not run, take a GEMM over the
    weight dequantized `INT8_GROUP_CHUNK` output rows at a time (a prefill's rows: a bf16 GEMM
    does half the kernel's VDPBF16PS work per product).

    Args:
        values: ``[out, in]`` int8.
        scales: ``[out, in / group]`` float16 or float32.
        dtype: The activation dtype.
        mins: ``[out, in / group]`` float32, or None.
        bias: ``[out]`` or None.
    """

    def __init__(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        dtype: torch.dtype,
        mins: torch.Tensor | None = None,
        bias: nn.Parameter | None = None,
    ) -> None:
        super().__init__(values, scales, dtype, mins)
        self.out_features, self.in_features = values.shape
        self.bias = bias
        self.min_rows = 1
        """Fewer rows run padded to this many (`pdserve.engine.batch_invariant`); above one,
        pdserve's kernel runs every row count (its rows are independent of each other)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        out = int8_group_matmul(x, self.values, self.scales, self.mins, self.kernel, self.min_rows)
        return out if self.bias is None else out.add_(self.bias)


def int8_group_matmul(
    x: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    kernel: str,
    min_rows: int,
    kernel_rows: int = OWN_KERNEL_MAX_ROWS,
) -> torch.Tensor:
    """``x @ w.T`` for an int8 weight in groups ``w = scale * values + min``, as
    `Int8GroupLinear` runs it: on pdserve's kernel up to `kernel_rows` rows (every row count
    where `min_rows` is above one), else one GEMM over the weight dequantized
    `INT8_GROUP_CHUNK` output rows at a time, `x` padded to `min_rows`.

    Args:
        x: ``[rows, in]``.
        values: ``[out, in]`` int8.
        scales: ``[out, in / group]`` float16 or float32.
        mins: ``[out, in / group]`` float32, or None.
        kernel: ``pdserve`` where pdserve's int8 kernel takes the shape and dtype, else
            ``torch``.
        min_rows: Fewer rows run padded to this many (`pdserve.engine.batch_invariant`).
        kernel_rows: Most rows the kernel multiplies where `min_rows` is one.

    Returns:
        ``[rows, out]`` in x's dtype.
    """
    if kernel == "pdserve" and (x.shape[0] <= kernel_rows or min_rows > 1):
        return int8_kernel.matmul(x, values, scales, mins)
    rows, num_out = x.shape[0], values.shape[0]
    x = at_least_rows(x, min_rows)
    out = torch.empty(x.shape[0], num_out, dtype=x.dtype)
    for start in range(0, num_out, INT8_GROUP_CHUNK):
        stop = min(start + INT8_GROUP_CHUNK, num_out)
        part = None if mins is None else mins[start:stop]
        if kernel == "pdserve" and x.dtype == torch.bfloat16:
            weight = int8_kernel.dequantize(values[start:stop], scales[start:stop], part)
        else:
            weight = int8_kernel.dequantize_torch(
                values[start:stop], scales[start:stop], part, x.dtype
            )
        torch.mm(x, weight.t(), out=out[:, start:stop])
    return out[:rows]


class Int8GroupEmbedding(Int8Groups):
    """The token embedding over `Int8GroupLinear`'s int8 rows (a tied LM head's own tensors, or
    an untied embedding's): a lookup dequantizes only the rows it reads.

    Made as an `Int8Groups` is: values ``[vocab, hidden]``, and `dtype` the rows' it returns.
    """

    @property
    def embedding_dim(self) -> int:
        return int(self.values.shape[1])

    @classmethod
    def tied_to(cls, head: Int8GroupLinear, dtype: torch.dtype) -> Int8GroupEmbedding:
        """The embedding that reads `head`'s tensors (stored once)."""
        return cls(head.values, head.scales, dtype, head.mins)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [...] -> [..., embedding_dim]
        ids = input_ids.reshape(-1)
        # NOTE: the compiled lookup writes bf16 rows; float32 ones come from torch's ops (the
        # same values, exact in float32).
        if self.kernel == "pdserve" and self.dtype == torch.bfloat16:
            rows = int8_kernel.dequantize(self.values, self.scales, self.mins, ids)
        else:
            mins = None if self.mins is None else self.mins[ids]
            rows = int8_kernel.dequantize_torch(
                self.values[ids], self.scales[ids], mins, self.dtype
            )
        return rows.view(*input_ids.shape, self.embedding_dim)


def _torch_scale_zeros(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """torch's int4 kernel's ``[in / group, out, 2]`` scales and zeros in `dtype`: it computes
    ``(q - 8) * scale + zero``, exact in float32 with ``zero = min + 8 * scale``.

    NOTE: a scale rounded to bf16 is off by up to 2^-9 of itself, an error of ``(q - 8) *
    (scale - rounded)`` in every weight of the group; the zero takes that error's mean over the
    group's own values (a least-squares fit of the rounded scale): perplexity on the default
    model 16.93 against 17.05 with the plain zero (float32, the file's values exactly: 16.93).
    """
    scale = scales.to(dtype)
    num_out, num_groups = scales.shape
    sum_q = q.view(num_out, num_groups, INT4_GROUP_SIZE).sum(dim=-1, dtype=torch.int32)
    error = (scales - scale.float()) * (sum_q / INT4_GROUP_SIZE - 8)
    zero = (mins + 8 * scales + error).to(dtype)
    return torch.stack([scale.t(), zero.t()], dim=-1).contiguous()


def quantize_int8(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``weight ~= values * scales[:, None]``.

    Args:
        weight: ``[out, in]`` floating point.
        scale_dtype: The dtype the scales are stored (and the kernel runs) in.

    Returns:
        ``[out, in]`` int8 values and ``[out]`` scales in `scale_dtype`.
    """
    weight = weight.float().contiguous()
    # NOTE: the values are rounded against the scale as stored: a bf16 scale rounded after
    # the fact would shift a whole output channel by up to 0.4%.
    scales = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127).to(scale_dtype)
    values = (weight / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return values, scales


def quantize_int4(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group_size` input features.

    The kernel's dequantization is ``(value - 8) * scale + zero``; with ``zero = min + 8 *
    scale`` that is ``value * scale + min``, so each group's range maps onto 0..15.

    Args:
        weight: ``[out, in]`` floating point, ``in`` a multiple of `group_size`.
        group_size: Input features per scale and zero.
        scale_dtype: The dtype the scales and zeros are stored (and the kernel runs) in.

    Returns:
        ``[out, in]`` int32 values in 0..15 and ``[in / group_size, out, 2]`` scales and zeros
        in `scale_dtype`.
    """
    num_out, num_in = weight.shape
    # groups: [out, in / group_size, group_size]
    groups = weight.float().contiguous().view(num_out, num_in // group_size, group_size)
    low = groups.amin(dim=-1, keepdim=True)
    high = groups.amax(dim=-1, keepdim=True)
    # NOTE: as in `quantize_int8`, the values are rounded against the stored scale and zero.
    scales = ((high - low) / 15).clamp(min=1e-12).to(scale_dtype).float()
    zeros = (low + 8 * scales).to(scale_dtype).float()
    values = ((groups - zeros) / scales + 8).round().clamp(0, 15).to(torch.int32)
    scale_zeros = torch.stack([scales.squeeze(-1).t(), zeros.squeeze(-1).t()], dim=-1)
    return values.view(num_out, num_in), scale_zeros.to(scale_dtype).contiguous()


def dequantize_int4(values: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` float32 weight that `quantize_int4`'s output stands for."""
    num_out, num_in = values.shape
    num_groups = scale_zeros.shape[0]
    scales = scale_zeros[..., 0].t().unsqueeze(-1).float()
    zeros = scale_zeros[..., 1].t().unsqueeze(-1).float()
    groups = values.view(num_out, num_groups, -1).float()
    return ((groups - 8) * scales + zeros).view(num_out, num_in)


def can_quantize_int4(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether torch's int4 CPU kernel takes this shape."""
    return in_features % group_size == 0 and out_features % _INT4_OUT_MULTIPLE == 0


class QuantizationReport(NamedTuple):
    """What `quantize_linears` did.

    Attributes:
        num_quantized: Projections now quantized.
        num_kept: Projections left in the model dtype (skipped, or a shape the kernel refuses).
    """

    num_quantized: int
    num_kept: int


def quantize_linears(
    model: nn.Module, method: str, skip: Collection[nn.Module] = ()
) -> QuantizationReport:
    """Replaces every `Linear` of `model` (but those in `skip`) by its quantized form.

    Args:
        model: A loaded model on CPU.
        method: ``int8`` or ``int4``.
        skip: Projections to keep in the model dtype (the LM head).

    Raises:
        ValueError: For an unknown method.
    """
    if method not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {method!r}; choose int8 or int4")
    num_quantized = num_kept = 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, Linear)
    ]
    for parent, name, linear in targets:
        in_features, out_features = linear.weight_t.shape
        if any(linear is s for s in skip) or (
            method == "int4" and not can_quantize_int4(in_features, out_features, INT4_GROUP_SIZE)
        ):
            num_kept += 1
            continue
        quantized = Int8Linear(linear) if method == "int8" else Int4Linear.from_linear(linear)
        setattr(parent, name, quantized)
        num_quantized += 1
    return QuantizationReport(num_quantized, num_kept)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (what a decode step streams, at most)."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [
        m.packed_weight
        for m in model.modules()
        if isinstance(m, Linear) and m.packed_weight is not None
    ]
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor.is_mkldnn:
            # NOTE: a oneDNN-packed weight has no storage to look at; its blocked layout holds
            # the same elements (padding aside).
            total += tensor.numel() * tensor.element_size()
            continue
        # NOTE: the tied embedding and LM head share one storage; count it once.
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total
