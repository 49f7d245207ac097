"""The parts of a model's architecture below `ModelConfig`: RoPE, mixture-of-experts and
latent-attention settings, and the error a refused model raises (the families are
`pdserve.engine.families`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelLoadError(ValueError):
    """A model directory the engine refuses: an unknown family, a setting it does not
    implement, or a checkpoint that does not match its config. The message says which."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters.

    Attributes:
        theta: Base wavelength (``rope_theta``).
        rope_type: ``default``, ``linear`` or ``llama3``.
        factor: Scaling factor (``linear`` and ``llama3``).
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_position_embeddings: ``llama3`` and ``yarn``: the pre-training context
            length.
        beta_fast: ``yarn``: rotations that bound the band of frequencies kept as they are.
        beta_slow: ``yarn``: rotations that bound the band of frequencies interpolated.
        truncate: ``yarn``: round that band's bounds outward to whole dims.
        attention_factor: ``yarn``: multiplies cos and sin; from `factor` (and `mscale`,
            `mscale_all_dim`) when the config gives none.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be positive")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 rope needs high_freq_factor > low_freq_factor")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> RopeConfig:
        """Reads ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``."""
        params = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or {}
        merged = {**scaling, **params}
        theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = merged.get("rope_type", merged.get("type", "default"))
        factor = float(merged.get("factor", 1.0))
        return cls(
            theta=float(theta),
            rope_type=str(rope_type),
            factor=factor,
            low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
            high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                merged.get("original_max_position_embeddings", 8192)
            ),
            beta_fast=float(merged.get("beta_fast") or 32.0),
            beta_slow=float(merged.get("beta_slow") or 1.0),
            truncate=bool(merged.get("truncate", True)),
            attention_factor=_yarn_attention_factor(merged, factor) if rope_type == "yarn" else 1.0,
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched by `factor` (transformers'
    ``get_mscale``): 1 when not stretched."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    """YaRN's cos/sin multiplier as transformers derives it when the config gives none."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts feed-forward (Mixtral, Qwen2-MoE, Qwen3-MoE, ERNIE 4.5 MoE,
    GLM-4.5, gpt-oss).

    Attributes:
        num_experts: Routed experts per MoE layer.
        num_experts_per_tok: Experts each token is routed to (top-k).
        moe_intermediate_size: Hidden size of one routed expert.
        norm_topk_prob: Renormalise the top-k routing weights to sum to one.
        shared_expert_intermediate_size: Qwen2-MoE's always-on shared expert (0: none).
        is_weighting_in_float32: Scale the experts' outputs by the float32 routing weights
            and round after (Mixtral), instead of rounding the weights to the model dtype
            first (Qwen); the two differ in bfloat16 only.
        moe_layers: Per layer, whether its feed-forward is the MoE block (else a dense MLP of
            ``intermediate_size``).
        is_shared_expert_gated: The shared expert's output is scaled by a sigmoid gate
            (Qwen2-MoE), or added as it is (ERNIE 4.5's ``shared_experts``).
        has_score_correction: A per-expert bias added to the routing probabilities to choose
            the top-k (ERNIE 4.5's ``e_score_correction_bias``); the weights stay the
            probabilities without it.
        norm_min: With `norm_topk_prob`, the least sum the top-k weights are divided by.
        scoring: ``softmax`` over the router's logits, ``sigmoid`` of each (GLM-4.5, as
            DeepSeek-V3), computed in float32, or ``top_logits``: the top-k logits chosen first,
            then a softmax over them alone (gpt-oss).
        num_groups: The experts are split into this many groups; a token's experts come from
            the `topk_groups` best groups (group-limited routing; one group: no limit).
        topk_groups: See `num_groups`.
        group_score: How a group scores: ``top2_sum``, its two best corrected scores summed
            (DeepSeek-V3, GLM-4.5), or ``max``, its best (DeepSeek-V2's
            ``group_limited_greedy``).
        routed_scaling_factor: Multiplies the routing weights after any renormalisation.
        router_bias: The router's projection has a bias (gpt-oss).
        expert_bias: Each expert's projections have biases (gpt-oss).
        clamped_swiglu: gpt-oss's expert activation with this ``(alpha, limit)``: gate and up
            interleaved in the checkpoint, the gate clamped above at limit, the up to
            ``[-limit, limit]``, and ``(up + 1) * gate * sigmoid(alpha * gate)``; None: the
            model's ``hidden_act`` gating.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    moe_layers: tuple[bool, ...]
    shared_expert_intermediate_size: int = 0
    is_weighting_in_float32: bool = False
    is_shared_expert_gated: bool = True
    has_score_correction: bool = False
    norm_min: float = 0.0
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2_sum"
    routed_scaling_factor: float = 1.0
    router_bias: bool = False
    expert_bias: bool = False
    clamped_swiglu: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.num_experts <= 0 or self.moe_intermediate_size <= 0:
            raise ValueError("num_experts and moe_intermediate_size must be positive")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..{self.num_experts}, "
                f"got {self.num_experts_per_tok}"
            )
        if self.scoring not in ("softmax", "sigmoid", "top_logits"):
            raise ValueError(f"unsupported expert scoring {self.scoring!r}")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"{self.num_experts} experts do not split into {self.num_groups} groups with "
                f"{self.topk_groups} chosen"
            )


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): each token's K and V come from one
    compressed latent of `kv_lora_rank` values and a `qk_rope_head_dim` rotated key shared by
    every head, and that latent (``kv_lora_rank + qk_rope_head_dim`` values) is what the cache
    holds (`pdserve.engine.mla`).

    Attributes:
        q_lora_rank: The query's own compression (``q_a_proj`` then ``q_b_proj``); None: one
            ``q_proj``.
        kv_lora_rank: The latent's size.
        qk_nope_head_dim: Dims of a head's query and key without RoPE.
        qk_rope_head_dim: Dims with RoPE (the key's shared by every head).
        v_head_dim: Dims of a head's value.
        is_rope_interleaved: RoPE over adjacent pairs (``rope_interleave``).
        softmax_scale: ``(qk_nope + qk_rope) ** -0.5``, times YaRN's ``mscale ** 2``.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    is_rope_interleaved: bool
    softmax_scale: float

    @property
    def latent_size(self) -> int:
        """Values the cache holds per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def __post_init__(self) -> None:
        if self.latent_size % 2:
            raise ValueError(
                f"kv_lora_rank + qk_rope_head_dim must be even, got {self.latent_size}"
            )
