"""Sparse mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, and the other MoE
families).

A router scores every expert per token; each token runs through its top-k experts and their
outputs are summed with the routing weights. The experts run grouped: the tokens routed to one
expert are gathered and go through it as one matrix product, expert after expert, so a step
costs one GEMM pair per expert hit, not one per token. The experts' weights are in the model's
dtype (`Experts`), or kept as the checkpoint holds them quantized (`KeptExperts`): MXFP4 codes
as they are, int8 groups for a GGUF's 8-, 6- and 5-bit types, int4 groups for its 4-bit ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import pdserve.engine.int4_kernel as int4_kernel
import pdserve.engine.int8_kernel as int8_kernel
from pdserve.engine.layers import gated_activation
from pdserve.engine.linear import can_pack_for_onednn, invariant_rows, onednn_linear
from pdserve.engine.model_config import ModelConfig, ModelLoadError, MoeConfig
from pdserve.engine.packed_weights import E2M1_VALUES, MXFP4_BLOCK, Mxfp4Codes
from pdserve.engine.parallel.group import RankShard, TensorParallelGroup
from pdserve.engine.quant import int8_group_matmul

E2M1_TABLE = int4_kernel.table_of(E2M1_VALUES)
"""MXFP4's 16 e2m1 values as the int4 kernel's table."""


class Experts(nn.Module):
    """The routed experts' weights as 3-D tensors, ``[in, out]`` per expert like `Linear`.

    Attributes:
        gate_up_proj: ``[num_experts, hidden_size, 2 * moe_intermediate_size]``, gate then up.
        down_proj: ``[num_experts, moe_intermediate_size, hidden_size]``.
        gate_up_proj_bias: ``[num_experts, 2 * moe_intermediate_size]``, with
            `MoeConfig.expert_bias`.
        down_proj_bias: ``[num_experts, hidden_size]``, likewise.
    """

    def __init__(
        self, moe: MoeConfig, hidden_size: int, hidden_act: str, shard: RankShard | None = None
    ) -> None:
        super().__init__()
        self.num_experts = moe.num_experts
        # NOTE: tensor-parallel ranks split every expert along its intermediate size.
        shard = shard or RankShard()
        size = len(shard.span(moe.moe_intermediate_size))
        self.intermediate_size = size
        self.hidden_act = hidden_act
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, 2 * size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, size, hidden_size))
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if moe.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(moe.num_experts, 2 * size))
            self.down_proj_bias = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.is_adding_down_bias = shard.rank == 0
        """Whether this rank adds `down_proj_bias`: the ranks' outputs are summed, so one
        rank adds it (each weighted by its token's routing weight, as without ranks)."""
        self.clamped_swiglu = moe.clamped_swiglu
        self.min_rows = 1
        """An expert given fewer tokens runs them padded to this many
        (`pdserve.engine.batch_invariant`)."""

    def forward(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Sums each token's experts' outputs, weighted.

        Args:
            x: ``[num_tokens, hidden_size]``.
            expert_ids: ``[num_tokens, top_k]`` the experts of each token.
            weights: ``[num_tokens, top_k]`` their routing weights.

        Returns:
            ``[num_tokens, hidden_size]``.
        """
        top_k = expert_ids.shape[1]
        flat_ids = expert_ids.flatten()
        flat_weights = weights.flatten()
        # order: the (token, k) slots sorted by expert, each expert's slots contiguous
        order = flat_ids.argsort(stable=True)
        # NOTE: one host read per MoE layer for the group sizes the loop needs.
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            start += count
            tokens = slots // top_k
            # gate_up: [count, 2 * intermediate_size]
            gate_up = self.project(x[tokens], expert, "gate_up")
            if self.gate_up_proj_bias is not None:
                gate_up = gate_up + self.gate_up_proj_bias[expert]
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = self.project(self._activation(gate, up), expert, "down")
            if self.down_proj_bias is not None and self.is_adding_down_bias:
                hidden = hidden + self.down_proj_bias[expert]
            out.index_add_(0, tokens, (hidden * flat_weights[slots, None]).to(out.dtype))
        return out

    def project(self, x: torch.Tensor, expert: int, which: str) -> torch.Tensor:
        """``x`` (``[rows, in]``) through one expert's ``gate_up`` or ``down`` projection,
        ``[rows, out]``."""
        weight = self.gate_up_proj[expert] if which == "gate_up" else self.down_proj[expert]
        if self.min_rows > 1 and can_pack_for_onednn(x.device, x.dtype):
            # NOTE: oneDNN's GEMM over the ``[out, in]`` weight (`lay_out_for_onednn`) sums a
            # row alike for 2 to `INVARIANT_MAX_ROWS` rows; torch.mm's over ``[in, out]``
            # does not (bf16 on a CPU with AMX: from 7 rows for gpt-oss's sizes).
            return invariant_rows(lambda rows: onednn_linear(rows, weight.t()), x, self.min_rows)
        return invariant_rows(lambda rows: torch.mm(rows, weight), x, self.min_rows)

    def lay_out_for_onednn(self) -> None:
        """Stores each expert's weight ``[out, in]`` in memory (the same ``[in, out]`` view):
        what oneDNN's GEMM takes without a copy (`pdserve.engine.batch_invariant`)."""
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name)
            weight.data = weight.data.transpose(1, 2).contiguous().transpose(1, 2)

    def _activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.clamped_swiglu is None:
            return gated_activation(self.hidden_act, gate, up)
        alpha, limit = self.clamped_swiglu
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class KeptExperts(Experts):
    """`Experts` whose weights stay quantized as the checkpoint holds them, each the file's own
    value, ``[experts, out, in]`` per projection (`PARTS`) in one of three forms:

    * **mxfp4**: gpt-oss's released MXFP4 experts as they are, a 4-bit e2m1 code a weight and
      its block's power-of-two scale per 32 (4.5 bits a weight: the scale in float16, float32
      where one is out of its range), on the int4 kernel through its table of the 16 e2m1
      values (`pdserve.engine.int4_kernel.table_of`), where it takes the projection's width
      (`load_mxfp4`);
    * **int8** groups ``scale * value + min`` of 16 or 32 input features, like
      `pdserve.engine.quant.Int8GroupLinear`'s: MXFP4 experts where the int4 kernel does not
      take them (an e2m1 value times two is an integer in -12..12 and its scale halved a power
      of two, `pdserve.engine.packed_weights.Mxfp4Codes.as_int8`: 8.5 bits a weight), a GGUF's
      Q8_0, Q6_K and Q5_K experts, and its 4-bit ones where the int4 kernel does not take the
      shape (widened, exactly);
    * **int4** groups ``scale * q + min`` of 32, q in 0..15, like
      `pdserve.engine.quant.Int4Linear`'s on pdserve's kernel: a GGUF's Q4_0, Q4_1 and Q4_K
      experts (4.5-5 bits a weight), where the projection's input width is a multiple of 64
      (`load_int4`).

    Each expert's projection runs as the matching linear runs one: pdserve's kernel up to
    `KERNEL_MAX_ROWS` rows (every row count in `--deterministic` mode, whose rows must not
    depend on each other), a GEMM over the expert's weight dequantized for more. Built where
    the int8 kernel takes both projections (`why_not`; the int4 one runs where it does); the
    loader fills the tensors (`load_int8`, `load_int4`).

    Attributes:
        forms: Each part's form (``gate_up``, ``down`` -> ``int8``, ``int4`` or ``mxfp4``).
        gate_up_values: int8: ``[num_experts, 2 * moe_intermediate_size, hidden_size]``, gate
            then up; int4 and mxfp4: ``[num_experts, 2 * moe_intermediate_size, hidden_size /
            2]`` uint8 in the int4 kernel's order (`pdserve.engine.int4_kernel.pack`).
        gate_up_scales: ``[num_experts, 2 * moe_intermediate_size, hidden_size / group]``
            float16 or float32.
        gate_up_mins: int8: likewise float32, or None; int4: ``[num_experts, hidden_size / 32,
            2 * moe_intermediate_size]`` (transposed, as the int4 kernel reads them) in the
            scales' dtype; mxfp4: None.
        down_values, down_scales, down_mins: Likewise for ``down_proj`` (``[num_experts,
            hidden_size, moe_intermediate_size]`` and so on).
    """

    PARTS = ("gate_up_proj", "down_proj")
    KERNEL_MAX_ROWS = 16
    """Most rows an expert's projection runs on the kernel: a gpt-oss-20b expert's gate and up
    (``[5760, 2880]``, one thread) took 2.98 ms for 16 rows on it against 3.75 ms dequantized
    for a GEMM, 5.38 against 4.60 ms for 24 (a projection's 8, `OWN_KERNEL_MAX_ROWS`, is
    measured on smaller weights, whose dequantization costs less)."""

    def __init__(self, moe: MoeConfig, hidden_size: int, hidden_act: str) -> None:
        super().__init__(moe, hidden_size, hidden_act)
        del self.gate_up_proj, self.down_proj
        self.hidden_size = hidden_size
        size, num = self.intermediate_size, moe.num_experts
        shapes = {"gate_up": (num, 2 * size, hidden_size), "down": (num, hidden_size, size)}
        for which, shape in shapes.items():
            self.register_buffer(f"{which}_values", torch.empty(shape, dtype=torch.int8))
            scales = (*shape[:-1], shape[-1] // MXFP4_BLOCK)
            self.register_buffer(f"{which}_scales", torch.empty(scales, dtype=torch.float16))
            self.register_buffer(f"{which}_mins", None)
        self.forms = dict.fromkeys(shapes, "int8")
        self.kernel = "pdserve"
        """pdserve's kernels (`why_not` says where they would not run)."""

    def lay_out_for_onednn(self) -> None:
        """Nothing to lay out: the kept weights are ``[out, in]`` already, and run on pdserve's
        kernels at every row count under `pdserve.engine.batch_invariant`."""

    @classmethod
    def placeholder(cls, config: ModelConfig, dtype: torch.dtype) -> KeptExperts:
        """A model's experts on the meta device, their tensors for `load_int8` or `load_int4`
        to put in."""
        assert config.moe is not None
        with torch.device("meta"):
            experts = cls(config.moe, config.hidden_size, config.hidden_act)
        return experts.to(dtype)

    @staticmethod
    def why_not(moe: MoeConfig, hidden_size: int, dtype: torch.dtype) -> str | None:
        """Why pdserve's int8 kernel does not take the experts' projections (None where it
        takes both)."""
        return int8_kernel.why_not(dtype, hidden_size) or int8_kernel.why_not(
            dtype, moe.moe_intermediate_size
        )

    def load_int8(
        self,
        part: str,
        values: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None = None,
    ) -> None:
        """Takes one projection of every expert (`PARTS`) in the int8 form: ``values``
        ``[experts, out, in]`` int8, ``scales`` ``[experts, out, in / group]`` (16 or 32 input
        features a group) float16 or float32, held in float16 where each is exact there, and
        ``mins`` likewise (float32) or None.

        Raises:
            ModelLoadError: Where the shapes are not this model's or the kernel's.
        """
        which = part.removesuffix("_proj")
        expected = self._expected(which)
        try:
            if values.shape != expected or scales.shape[0] != expected[0]:
                raise ValueError(f"expected {tuple(expected)} values")
            int8_kernel.group_of(values[0], scales[0])  # NOTE: the kernel's dtypes and groups
            if mins is not None and mins.shape != scales.shape:
                raise ValueError(f"mins {tuple(mins.shape)} do not fit the scales")
        except ValueError as error:
            raise ModelLoadError(
                f"int8 experts {part!r} hold {tuple(values.shape)} {values.dtype} values and "
                f"{tuple(scales.shape)} scales: {error}"
            ) from error
        halves = scales.to(torch.float16)
        if torch.equal(halves.float(), scales.float()):
            scales = halves
        self._put(which, "int8", values, scales, None if mins is None else mins.float())

    @staticmethod
    def mxfp4_form(hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> str:
        """The form MXFP4 experts take with `dtype` activations: ``mxfp4`` where the int4
        kernel takes both projections' input widths through its table, else ``int8``."""
        widths = (hidden_size, intermediate_size)
        takes = all(int4_kernel.why_not(dtype, width) is None for width in widths)
        return "mxfp4" if takes else "int8"

    def load_mxfp4(self, part: str, weight: Mxfp4Codes, dtype: torch.dtype) -> None:
        """Takes one projection of every expert (`PARTS`) as MXFP4 codes and scales,
        ``[experts, out, in]`` and ``[experts, out, in / 32]``, in the form `mxfp4_form` picks
        for `dtype` activations: the codes packed for the int4 kernel, or int8 groups.

        Raises:
            ModelLoadError: Where the shapes are not this model's or the kernel's.
        """
        which = part.removesuffix("_proj")
        if self.mxfp4_form(self.hidden_size, self.intermediate_size, dtype) == "int8":
            self.load_int8(part, *weight.as_int8())
            return
        expected = self._expected(which)
        codes, scales = weight
        if codes.shape != expected or scales.shape != (*expected[:2], expected[2] // MXFP4_BLOCK):
            raise ModelLoadError(
                f"mxfp4 experts {part!r} hold {tuple(codes.shape)} codes and "
                f"{tuple(scales.shape)} scales; expected {tuple(expected)}"
            )
        halves = scales.to(torch.float16)
        if torch.equal(halves.float(), scales):
            scales = halves
        packed = torch.stack([int4_kernel.pack(expert) for expert in codes])
        self._put(which, "mxfp4", packed, scales, None)

    def load_int4(
        self, part: str, values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
    ) -> None:
        """Takes one projection of every expert (`PARTS`) in the int4 form, as a GGUF's Q4_0,
        Q4_1 and Q4_K blocks hold it (`pdserve.engine.gguf_int4`): ``values`` ``[experts, out,
        in / 2]`` uint8 (column ``2i`` in the low nibble, ``2i + 1`` in the high one),
        ``scales`` and ``mins`` ``[experts, out, in / 32]`` float32; the scales and mins are
        held in float16 where every one is exact there.

        Raises:
            ModelLoadError: Where the shapes are not this model's or the int4 kernel's.
        """
        which = part.removesuffix("_proj")
        num, num_out, num_in = self._expected(which)
        groups = (num, num_out, num_in // int4_kernel.GROUP)
        if (
            values.shape != (num, num_out, num_in // 2)
            or scales.shape != groups
            or mins.shape != groups
            or num_in % int4_kernel.PAIR
        ):
            raise ModelLoadError(
                f"int4 experts {part!r} hold {tuple(values.shape)} values, {tuple(scales.shape)} "
                f"scales and {tuple(mins.shape)} mins; expected {(num, num_out, num_in // 2)} "
                f"and {groups}, {num_in} inputs a multiple of {int4_kernel.PAIR}"
            )
        scale_dtype = int4_kernel.scale_dtype(scales, mins)
        # NOTE: each expert's [out, in] values in 0..15, packed in the kernel's order
        packed = torch.stack([int4_kernel.pack(int4_kernel.unpack_nibbles(v)) for v in values])
        self._put(
            which, "int4", packed, scales.to(scale_dtype), mins.transpose(1, 2).to(scale_dtype)
        )

    def _expected(self, which: str) -> tuple[int, int, int]:
        """A part's ``[experts, out, in]`` shape."""
        size, num = self.intermediate_size, self.num_experts
        if which == "gate_up":
            return num, 2 * size, self.hidden_size
        return num, self.hidden_size, size

    def _put(
        self,
        which: str,
        form: str,
        values: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
    ) -> None:
        self._buffers[f"{which}_values"] = values.contiguous()
        self._buffers[f"{which}_scales"] = scales.contiguous()
        self._buffers[f"{which}_mins"] = None if mins is None else mins.contiguous()
        self.forms[which] = form

    def project(self, x: torch.Tensor, expert: int, which: str) -> torch.Tensor:
        values = getattr(self, f"{which}_values")[expert]
        scales = getattr(self, f"{which}_scales")[expert]
        mins = getattr(self, f"{which}_mins")
        if self.forms[which] in ("int4", "mxfp4"):
            table = E2M1_TABLE if self.forms[which] == "mxfp4" else None
            own_mins = None if mins is None else mins[expert]
            if x.shape[0] <= self.KERNEL_MAX_ROWS or self.min_rows > 1:
                return int4_kernel.matmul(x, values, scales, own_mins, table)
            weight = int4_kernel.dequantize(values, scales, own_mins, x.dtype, table)
            return torch.mm(x, weight.t())
        return int8_group_matmul(
            x,
            values,
            scales,
            None if mins is None else mins[expert],
            self.kernel,
            self.min_rows,
            self.KERNEL_MAX_ROWS,
        )


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) a gated shared expert.

    Args:
        config: A model config with `ModelConfig.moe` set.
        linear: The projection class of the model (``Linear(in, out, bias)``).
        mlp: The dense MLP class (``mlp(config, intermediate_size, group)``) for the shared
            expert.
        group: The rank's tensor-parallel group: the router is replicated, the experts split
            along their intermediate size and their outputs summed over the ranks.
    """

    def __init__(
        self,
        config: ModelConfig,
        linear: type[nn.Module],
        mlp: type[nn.Module],
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        if config.moe is None:
            raise ValueError("SparseMoeBlock needs a config with moe set")
        self.moe = config.moe
        self.group = group or TensorParallelGroup.single()
        self.gate = linear(config.hidden_size, self.moe.num_experts, self.moe.router_bias)
        self.experts = Experts(self.moe, config.hidden_size, config.hidden_act, self.group.shard)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        if self.moe.shared_expert_intermediate_size:
            self.shared_expert = mlp(config, self.moe.shared_expert_intermediate_size, self.group)
            if self.moe.is_shared_expert_gated:
                self.shared_expert_gate = linear(config.hidden_size, 1, False)
        self.score_correction: nn.Parameter | None = None
        if self.moe.has_score_correction:
            # NOTE: [1, experts] as ERNIE's checkpoints store it (one group).
            self.score_correction = nn.Parameter(torch.zeros(1, self.moe.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, hidden_size]`` -> ``[num_tokens, hidden_size]``."""
        weights, expert_ids = self._route(x)
        if not self.moe.is_weighting_in_float32:
            weights = weights.to(x.dtype)
        out = self.group.all_reduce(self.experts(x, expert_ids, weights))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, expert_ids)``, each ``[num_tokens, top_k]``, weights in float32."""
        moe = self.moe
        # router_logits: [num_tokens, num_experts]
        router_logits = self.gate(x)
        if moe.scoring == "top_logits":
            expert_ids = self.pick(router_logits)
            top = router_logits.gather(-1, expert_ids)
            return F.softmax(top, dim=-1, dtype=torch.float32), expert_ids
        if moe.scoring == "sigmoid":
            scores = router_logits.float().sigmoid()
        else:
            scores = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        choice = scores
        if self.score_correction is not None:
            choice = scores + self.score_correction.float().view(-1)
        expert_ids = self.pick(choice)
        weights = scores.gather(-1, expert_ids)
        if moe.norm_topk_prob:
            total = weights.sum(dim=-1, keepdim=True)
            if moe.norm_min:
                total = total.clamp(min=moe.norm_min)
            weights = weights / total
        if moe.routed_scaling_factor != 1.0:
            weights = weights * moe.routed_scaling_factor
        return weights, expert_ids

    def pick(self, choice: torch.Tensor) -> torch.Tensor:
        """Each row's `MoeConfig.num_experts_per_tok` experts, best first, by ``choice``
        (``[num_tokens, num_experts]``), within the row's best groups where the model groups
        its experts."""
        if self.moe.num_groups > 1:
            choice = self.within_best_groups(choice)
        return torch.topk(choice, self.moe.num_experts_per_tok, dim=-1).indices

    def within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with the experts outside each token's `topk_groups` best groups at -inf
        (`group_scores`)."""
        moe = self.moe
        group_scores = self.group_scores(choice)
        best = group_scores.topk(moe.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        grouped = choice.view(choice.shape[0], moe.num_groups, -1)
        return grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)

    def group_scores(self, choice: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, num_groups]``: each group's score, the sum of its two best experts'
        or its best (`MoeConfig.group_score`)."""
        # grouped: [num_tokens, num_groups, experts per group]
        grouped = choice.view(choice.shape[0], self.moe.num_groups, -1)
        if self.moe.group_score == "max":
            return grouped.max(dim=-1).values
        return grouped.topk(2, dim=-1).values.sum(dim=-1)
