"""The model architecture the engine builds (read from ``config.json`` by the rules of its
family, `pdserve.engine.families`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.engine.arch_config import (
    SUPPORTED_ACTIVATIONS,
    MlaConfig,
    ModelLoadError,
    MoeConfig,
    RopeConfig,
)
from pdserve.engine.families import model_config_fields, supported_model_types

__all__ = [
    "SUPPORTED_ACTIVATIONS",
    "MlaConfig",
    "ModelConfig",
    "ModelLoadError",
    "MoeConfig",
    "RopeConfig",
]


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only transformer of one of the families, as the engine
    builds it: each family's module (`pdserve.engine.families`) says which of these fields
    its ``config.json`` sets and how.

    Attributes:
        model_type: The ``model_type`` of one of the families (`supported_model_types`).
        sliding_windows: Per layer, the attention window in tokens or ``None`` (full attention).
        eos_token_ids: End-of-sequence ids from ``config.json`` and ``generation_config.json``.
        hidden_act: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (GeGLU).
        qk_norm: RMSNorm over each head of q and k before RoPE.
        is_qk_norm_across_heads: With `qk_norm`, one RMSNorm over all of q's heads and one over
            all of k's (OLMo 2) instead of one per head.
        rope_layers: Per layer, whether RoPE applies; every layer when empty (SmolLM3 leaves it
            out of every fourth).
        gemma_norms: Gemma's ``x * (1 + weight)`` RMSNorm.
        embed_scale: Multiplies the embeddings (Gemma: ``sqrt(hidden_size)``).
        attention_scale: The softmax scale, ``head_dim ** -0.5`` when ``None``.
        final_logit_softcapping: ``tanh(logits / c) * c`` when set.
        rotary_dim: How many leading dims of a head RoPE rotates (``partial_rotary_factor``).
        is_rope_interleaved: RoPE rotates adjacent pairs ``(2i, 2i + 1)`` of a head's dims
            (ERNIE 4.5), not its two halves. The loader reorders q's and k's rows of each head
            (evens first, then odds), which turns it into the half-split rotation the engine
            runs: the same products, q.k unchanged. It rotates in float32, as ERNIE's reference
            does.
        is_norm_scaled_in_float32: RMSNorm scales by its weight in float32 and rounds after
            (gpt-oss), instead of rounding the normed values first.
        has_attention_sinks: Each head has a learned sink logit that joins its softmax and
            takes a share of the weight to nothing (gpt-oss).
        local_rope: The RoPE of sliding-window layers when it differs (Gemma 3).
        moe: The mixture of experts, for the MoE families.
        mla: Multi-head latent attention (DeepSeek-V3), which replaces the usual attention.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_windows: tuple[int | None, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    hidden_act: str = "silu"
    qk_norm: bool = False
    is_qk_norm_across_heads: bool = False
    rope_layers: tuple[bool, ...] = ()
    gemma_norms: bool = False
    embed_scale: float | None = None
    attention_scale: float | None = None
    final_logit_softcapping: float | None = None
    rotary_dim: int | None = None
    is_rope_interleaved: bool = False
    is_norm_scaled_in_float32: bool = False
    has_attention_sinks: bool = False
    local_rope: RopeConfig | None = None
    moe: MoeConfig | None = None
    mla: MlaConfig | None = None

    def __post_init__(self) -> None:
        if self.model_type not in supported_model_types():
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; "
                f"supported: {', '.join(supported_model_types())}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                "num_attention_heads must be a multiple of num_key_value_heads "
                f"({self.num_attention_heads} vs {self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_windows and len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError("sliding_windows needs one entry per layer")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; "
                f"supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(f"rotary_dim must be even and in 1..{self.head_dim}")
        if self.rope_layers and len(self.rope_layers) != self.num_hidden_layers:
            raise ValueError("rope_layers needs one entry per layer")
        if self.moe is not None and len(self.moe.moe_layers) != self.num_hidden_layers:
            raise ValueError("moe.moe_layers needs one entry per layer")

    @property
    def cache_num_kv_heads(self) -> int:
        """KV heads of the cache's layout: one for MLA (its latent), else `num_key_value_heads`."""
        return 1 if self.mla is not None else self.num_key_value_heads

    @property
    def cache_head_dim(self) -> int:
        """Values per head in each of the cache's K and V: MLA's latent is split in two halves
        (the first in K, the second in V), so a block holds the latent and nothing more."""
        return self.mla.latent_size // 2 if self.mla is not None else self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    def sliding_window(self, layer_index: int) -> int | None:
        """The attention window of a layer in tokens, ``None`` for full attention."""
        return self.sliding_windows[layer_index] if self.sliding_windows else None

    @property
    def window_layers(self) -> tuple[int, ...]:
        """The layers with a sliding window."""
        return tuple(i for i, window in enumerate(self.sliding_windows) if window is not None)

    @property
    def widest_window(self) -> int:
        """The widest sliding window in tokens (0 without one)."""
        return max((w for w in self.sliding_windows if w is not None), default=0)

    def is_rope_layer(self, layer_index: int) -> bool:
        """Whether a layer rotates q and k (SmolLM3 leaves some out)."""
        return not self.rope_layers or self.rope_layers[layer_index]

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether a layer's feed-forward is the mixture of experts."""
        return self.moe is not None and self.moe.moe_layers[layer_index]

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Builds the config from the parsed ``config.json`` (and ``generation_config.json``).

        Raises:
            ValueError: For an architecture or setting the engine does not implement; the
                message names it and lists what is supported.
        """
        return cls(**model_config_fields(hf, generation))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Reads ``config.json`` (and ``generation_config.json`` if present) from a directory."""
        path = Path(model_dir)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"no config.json in model directory {str(path)!r}")
        hf = json.loads(config_file.read_text())
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
        try:
            return cls.from_hf_config(hf, generation)
        except (ValueError, KeyError) as error:
            raise ModelLoadError(f"{path}/config.json: {error}") from error
