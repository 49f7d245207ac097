"""The decoder layer most families share: attention (q/k norm, partial RoPE, a scale of the
family's own, sinks; or latent attention), the dense or expert feed-forward, and Llama's
pre-norm arrangement around them (`LlamaDecoderLayer`). `DecoderLayer` is what every
arrangement shares; where a layer's norms stand is data (`NormPlaces`): a family that places
them otherwise names its own (`PostNormDecoderLayer`: after each block; Gemma 3's: both)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.attention import PagedAttention, SdpaAttention
from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.batch_invariant import INVARIANT_BACKEND, InvariantAttention
from pdserve.engine.flash_attention import FlashAttention
from pdserve.engine.layers import gated_activation, make_norm, silu_mul, takes_silu_mul
from pdserve.engine.linear import Linear
from pdserve.engine.mla import MlaAttention
from pdserve.engine.model_config import ModelConfig, ModelLoadError
from pdserve.engine.moe import SparseMoeBlock
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.rope import apply_rotary

CosSin = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v projection, rotary embeddings and GQA.

    Optionally RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3) or across all
    heads (OLMo 2), a softmax scale of the family's own (Gemma 3), RoPE over the leading dims of
    a head only (Phi-3's ``partial_rotary_factor``) and no RoPE at all (``rope`` None: some of
    SmolLM3's layers).

    Column-parallel over the heads: a rank holds its share of the query heads (with their
    sinks) and of the KV heads (or its replica of one KV head), and the output projection sums
    over the ranks.
    """

    def __init__(
        self, config: ModelConfig, layer_index: int, backend: str, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        shard = group.shard
        self.num_heads = len(
            shard.q_head_range(config.num_attention_heads, config.num_key_value_heads)
        )
        self.num_kv_heads = len(shard.kv_head_range(config.num_key_value_heads))
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias, group)
        self.is_qk_norm_across_heads = config.is_qk_norm_across_heads
        if self.is_qk_norm_across_heads and group.world_size > 1:
            # NOTE: the norm's mean spans every head, which a rank holds only a share of.
            raise ModelLoadError(
                f"{config.model_type}'s q/k norm across all heads is not supported with "
                "tensor parallelism"
            )
        q_norm_size = self.q_size if self.is_qk_norm_across_heads else self.head_dim
        k_norm_size = self.kv_size if self.is_qk_norm_across_heads else self.head_dim
        self.q_norm = make_norm(config, q_norm_size) if config.qk_norm else None
        self.k_norm = make_norm(config, k_norm_size) if config.qk_norm else None
        attention_cls: type[PagedAttention] = SdpaAttention
        # NOTE: flash-attn has no sinks here: gpt-oss attends through SDPA.
        if backend == "flash" and not config.has_attention_sinks:
            attention_cls = FlashAttention
        elif backend == INVARIANT_BACKEND:
            attention_cls = InvariantAttention
        self.attn = attention_cls(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            config.sliding_window(layer_index),
            scale=config.attention_scale,
        )
        self.sinks: nn.Parameter | None = None
        if config.has_attention_sinks:
            # NOTE: one logit per query head: a rank holds its heads' (`shard_tensor`).
            self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def forward(
        self,
        hidden: torch.Tensor,
        rope: CosSin | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # qkv: [num_tokens, q_size + 2 * kv_size]
        qkv = self.qkv_proj(hidden)
        if self.is_qk_norm_across_heads and self.q_norm is not None and self.k_norm is not None:
            q_normed = self.q_norm(qkv[:, : self.q_size])
            k_normed = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size])
            qkv = torch.cat((q_normed, k_normed, qkv[:, self.q_size + self.kv_size :]), 1)
        # NOTE: q and k are rotated together in one pass.
        # qk: [num_tokens, num_heads + num_kv_heads, head_dim]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not self.is_qk_norm_across_heads:
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), 1
            )
        if rope is not None:
            qk = apply_rotary(qk, *rope).to(qkv.dtype)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        # out: [num_tokens, num_heads, head_dim]
        if self.sinks is not None and isinstance(self.attn, SdpaAttention):
            self.attn.sinks = self.sinks
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU for Gemma) with fused gate/up projection.

    Column-parallel gate/up over the intermediate size, row-parallel down projection.
    """

    def __init__(
        self,
        config: ModelConfig,
        intermediate_size: int | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        group = group or TensorParallelGroup.single()
        size = intermediate_size or config.intermediate_size
        self.intermediate_size = len(group.shard.span(size))
        self.hidden_act = config.hidden_act
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(
            self.intermediate_size, config.hidden_size, bias=config.mlp_bias, group=group
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up: [num_tokens, 2 * intermediate_size]
        gate_up = self.gate_up_proj(x)
        if self.hidden_act == "silu" and takes_silu_mul(gate_up):
            # NOTE: one call; the fused decode step's arithmetic (`pdserve.engine.fused_decode`).
            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(gated_activation(self.hidden_act, gate, up))


def feed_forward(config: ModelConfig, layer_index: int, group: TensorParallelGroup) -> nn.Module:
    """The layer's feed-forward: the experts on a MoE layer, else the dense MLP."""
    if config.is_moe_layer(layer_index):
        return SparseMoeBlock(config, Linear, LlamaMLP, group)
    return LlamaMLP(config, group=group)


@dataclass(frozen=True)
class NormPlaces:
    """Where a decoder layer's norms stand, each by its checkpoint's name (None: no norm
    there): on a block's input, or on its output before the residual add."""

    attention_input: str | None = None
    attention_output: str | None = None
    feed_forward_input: str | None = None
    feed_forward_output: str | None = None

    def names(self) -> tuple[str, ...]:
        """The norms' names, each once."""
        places = (
            self.attention_input,
            self.attention_output,
            self.feed_forward_input,
            self.feed_forward_output,
        )
        return tuple(name for name in places if name is not None)


# NOTE: "post_attention_layernorm" is the checkpoints' name for Llama's norm before the
# feed-forward.
PRE_NORMS = NormPlaces(
    attention_input="input_layernorm", feed_forward_input="post_attention_layernorm"
)
POST_NORMS = NormPlaces(
    attention_output="post_attention_layernorm", feed_forward_output="post_feedforward_layernorm"
)


class DecoderLayer(nn.Module):
    """A decoder layer: the attention block, then the feed-forward block, each one's output
    added to the residual, with norms where `norms` (the family's) places them.

    Args:
        config: The model's config.
        layer_index: This layer's index.
        backend: The attention backend's name.
        group: The tensor-parallel group.
    """

    norms = NormPlaces()

    def __init__(
        self, config: ModelConfig, layer_index: int, backend: str, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        for name in self.norms.names():
            self.add_module(name, make_norm(config, config.hidden_size))
        self.self_attn: nn.Module = (
            MlaAttention(config, group)
            if config.mla is not None
            else LlamaAttention(config, layer_index, backend, group)
        )
        self.mlp = feed_forward(config, layer_index, group)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: CosSin | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        norms = self.norms
        attended = self.self_attn(
            self._norm(norms.attention_input, hidden), rope, kv_cache, metadata
        )
        hidden = hidden + self._norm(norms.attention_output, attended)
        fed = self.mlp(self._norm(norms.feed_forward_input, hidden))
        return hidden + self._norm(norms.feed_forward_output, fed)

    def _norm(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        return x if name is None else self._modules[name](x)  # type: ignore[misc]


class LlamaDecoderLayer(DecoderLayer):
    """Pre-norm attention block followed by a pre-norm feed-forward (dense or experts)."""

    norms = PRE_NORMS


class PostNormDecoderLayer(DecoderLayer):
    """Each block's output normed, then added to the residual (OLMo 2's layer)."""

    norms = POST_NORMS
