"""The engine's projection: ``[in, out]`` weights, oneDNN-packed on CPU, row-parallel over a
tensor-parallel group."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.engine.parallel.group import TensorParallelGroup


def at_least_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` (``[num_rows, ...]``) with its first row repeated up to `rows` rows."""
    if x.shape[0] >= rows or x.shape[0] == 0:
        return x
    return torch.cat([x, x[:1].expand(rows - x.shape[0], *x.shape[1:])])


INVARIANT_MAX_ROWS = 32
"""The most rows a batch-invariant projection multiplies in one call. oneDNN's bf16 GEMM gives a
row the same bits for 2 to 32 rows on every CPU measured, and for any number from 2 on a CPU
without AMX; on one with AMX (Intel Xeon, Sapphire Rapids and later) a call of more than 32
rows takes the AMX kernels, which sum in another order."""


def invariant_rows(
    forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, min_rows: int
) -> torch.Tensor:
    """``forward(x)`` (``[rows, ...] -> [rows, ...]``, each row on its own); with `min_rows`
    above one (`pdserve.engine.batch_invariant`) in calls of `min_rows` to
    `INVARIANT_MAX_ROWS` rows: fewer rows run padded, more run that many at a time."""
    rows = x.shape[0]
    if min_rows <= 1 or rows == 0:
        return forward(x)
    if rows <= INVARIANT_MAX_ROWS:
        return forward(at_least_rows(x, min_rows))[:rows]
    parts = []
    for start in range(0, rows, INVARIANT_MAX_ROWS):
        part = x[start : start + INVARIANT_MAX_ROWS]
        parts.append(forward(at_least_rows(part, min_rows))[: part.shape[0]])
    return torch.cat(parts)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` on oneDNN's GEMM: `weight` ``[out, in]``, plain (contiguous) or
    packed (`Linear.pack_for_onednn`)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def can_pack_for_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `Linear.pack_for_onednn` can run here: float32, or bfloat16 where oneDNN runs it,
    on a CPU torch built with oneDNN."""
    return (
        device.type == "cpu"
        and (
            dtype == torch.float32
            or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear(nn.Module):
    """``y = x @ weight_t + bias``, the weight stored as ``[in_features, out_features]``.

    NOTE: decode is bound by streaming weights from memory; on CPU a GEMM over a row-major
    ``[in, out]`` matrix streams markedly faster for few rows (1.6x for one row) than
    ``F.linear`` over the ``[out, in]`` layout, and is no slower for many rows. Faster still on
    CPU is oneDNN's GEMM over a weight repacked into its blocked layout (`pack_for_onednn`):
    2.4-2.6x MKL's for 8 to 2048 rows on AMD EPYC (float32, one thread), where MKL does not
    take its AVX-512 paths; the engine packs every projection after loading. In bfloat16 the
    packed GEMM is 1.1-3x faster again than ``torch.mm`` (AVX512-BF16, one thread).

    With a `group` of several ranks the projection is row-parallel: each rank holds the rows
    of its share of ``in_features``, the partial products are summed over the ranks and the
    bias is added once, after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_weight: torch.Tensor | None = None
        self.group = group if group is not None and group.world_size > 1 else None
        self.min_rows = 1
        """Fewer rows run padded to this many; above one, more than `INVARIANT_MAX_ROWS`
        run that many at a time (`pdserve.engine.batch_invariant`)."""

    def pack_for_onednn(self, keep_weight: bool = False) -> None:
        """Repacks the weight for oneDNN (see `can_pack_for_onednn`) and uses it from now on.

        Args:
            keep_weight: Keep the ``[in, out]`` copy (a tied embedding shares it); otherwise
                its memory is released and `weight_t` becomes empty.
        """
        # NOTE: the batch-size hint only picks a layout; any number of rows runs on it.
        weight = self.weight_t.detach().t().contiguous()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        if not keep_weight:
            self.weight_t.data = self.weight_t.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        if self.min_rows == 1:
            return self._forward(x)
        return invariant_rows(self._forward, x, self.min_rows)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            return self._row_parallel(x)
        if self.packed_weight is not None:
            return onednn_linear(x, self.packed_weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def _row_parallel(self, x: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        if self.packed_weight is not None:
            y = onednn_linear(x, self.packed_weight)
        else:
            y = torch.mm(x, self.weight_t)
        y = self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias
