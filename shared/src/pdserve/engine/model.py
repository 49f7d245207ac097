"""The decoder of every supported family over a paged KV cache.

Llama, Qwen2, Mistral, Phi-3, Qwen3 (q/k norm), Mixtral and Qwen2/3-MoE (`moe`) share one layer
shape; Gemma 3 has norms after each block too (`GemmaDecoderLayer`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.engine.attention import SdpaAttention
from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.flash_attention import FlashAttention
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.layers import RMSNorm, gated_activation, make_norm
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.moe import SparseMoeBlock
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.layers import VocabParallelEmbedding, check_model_fits
from pdserve.engine.rope import RotaryEmbedding, apply_rotary

__all__ = ["LayerCallback", "Linear", "LlamaForCausalLM", "RMSNorm", "can_pack_for_onednn"]

LayerCallback = Callable[[int], None]


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
        if self.group is not None:
            return self._row_parallel(x)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def _row_parallel(self, x: torch.Tensor) -> torch.Tensor:
        assert self.group is not None
        if self.packed_weight is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")
        else:
            y = torch.mm(x, self.weight_t)
        y = self.group.all_reduce(y)
        return y if self.bias is None else y + self.bias


CosSin = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v projection, rotary embeddings and GQA.

    Optionally RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3), a softmax scale
    of the family's own (Gemma 3) and RoPE over the leading dims of a head only (Phi-3's
    ``partial_rotary_factor``).

    Column-parallel over the heads: a rank holds its share of the query heads and of the KV
    heads (or its replica of one KV head), and the output projection sums over the ranks.
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
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        attention_cls = FlashAttention if backend == "flash" else SdpaAttention
        self.attn = attention_cls(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            config.sliding_window(layer_index),
            scale=config.attention_scale,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rope: CosSin,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # qkv: [num_tokens, q_size + 2 * kv_size]
        qkv = self.qkv_proj(hidden)
        # NOTE: q and k are rotated together in one pass.
        # qk: [num_tokens, num_heads + num_kv_heads, head_dim]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), 1
            )
        qk = apply_rotary(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        # out: [num_tokens, num_heads, head_dim]
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
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(gated_activation(self.hidden_act, gate, up))


def _feed_forward(config: ModelConfig, layer_index: int, group: TensorParallelGroup) -> nn.Module:
    if config.is_moe_layer(layer_index):
        return SparseMoeBlock(config, Linear, LlamaMLP, group)
    return LlamaMLP(config, group=group)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm feed-forward (dense or experts)."""

    def __init__(
        self, config: ModelConfig, layer_index: int, backend: str, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, backend, group)
        self.mlp = _feed_forward(config, layer_index, group)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: CosSin,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class GemmaDecoderLayer(nn.Module):
    """Gemma 3's layer: each block normed before and after, then added to the residual."""

    def __init__(
        self, config: ModelConfig, layer_index: int, backend: str, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, backend, group)
        self.mlp = _feed_forward(config, layer_index, group)
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.pre_feedforward_layernorm = make_norm(config, config.hidden_size)
        self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: CosSin,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(fed)


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, backend: str, group: TensorParallelGroup) -> None:
        super().__init__()
        layer_cls = GemmaDecoderLayer if config.gemma_norms else LlamaDecoderLayer
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
            if group.world_size > 1
            else nn.Embedding(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            layer_cls(config, i, backend, group) for i in range(config.num_hidden_layers)
        )
        self.norm = make_norm(config, config.hidden_size)


class LlamaForCausalLM(nn.Module):
    """The causal LM: parameter names follow Hugging Face's except for the fused projections.

    Args:
        config: The architecture.
        attention_backend: ``sdpa`` or ``flash`` (already resolved for the device).
        group: This rank's tensor-parallel group: the model holds the rank's share (heads,
            intermediate sizes and vocabulary rows); a group of one when None.

    Raises:
        ValueError: If the group's size cannot split the model (`check_model_fits`).
    """

    def __init__(
        self,
        config: ModelConfig,
        attention_backend: str = "sdpa",
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        self.group = group or TensorParallelGroup.single()
        check_model_fits(config, self.group)
        self.model = LlamaModel(config, attention_backend, self.group)
        # NOTE: vocabulary-parallel: each rank computes the logits of its rows.
        num_rows = self.group.shard.vocab_per_rank(config.vocab_size)
        self.lm_head = Linear(config.hidden_size, num_rows, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.local_rotary: RotaryEmbedding | None = None
        # NOTE: Gemma 3's sliding layers rotate with a RoPE of their own.
        self.is_local_rope = tuple(
            config.local_rope is not None and config.sliding_window(i) is not None
            for i in range(config.num_hidden_layers)
        )

    def tie_weights(self) -> None:
        """Shares the embedding matrix with the LM head when the config says so (after loading).

        The LM head gets the contiguous ``[hidden, vocab]`` copy and the embedding becomes a
        transposed view of it, so the matrix is stored once.
        """
        if not self.config.tie_word_embeddings:
            return
        embedding = self.model.embed_tokens.weight.detach()
        self.lm_head.weight_t = nn.Parameter(embedding.t().contiguous(), requires_grad=False)
        self.model.embed_tokens.weight = nn.Parameter(
            self.lm_head.weight_t.t(), requires_grad=False
        )

    def pack_linears_for_onednn(self) -> int:
        """Packs every projection for oneDNN (CPU float32); returns how many were packed."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for linear in linears:
            linear.pack_for_onednn(keep_weight=linear is self.lm_head)
        return len(linears)

    def init_rotary(self, device: torch.device) -> None:
        """Builds the rotary tables on the model's device (call after weights are placed)."""
        rotary_dim = self.config.rotary_dim or self.config.head_dim
        self.rotary = RotaryEmbedding(self.config.rope, rotary_dim, device)
        if self.config.local_rope is not None:
            self.local_rotary = RotaryEmbedding(self.config.local_rope, rotary_dim, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        on_layer_done: LayerCallback | None = None,
    ) -> torch.Tensor:
        """Runs every layer over a flattened batch, writing its KV into the cache.

        Args:
            input_ids: ``[num_tokens]`` token ids of all sequences, concatenated.
            positions: ``[num_tokens]`` position of each token within its sequence.
            kv_cache: The paged cache, written at ``metadata.slot_mapping``.
            metadata: Block tables and sequence boundaries.
            on_layer_done: Called with the layer index right after that layer has run, i.e. once
                its KV for this batch is in the cache.

        Returns:
            ``[num_tokens, hidden_size]`` hidden states before the final norm.
        """
        if self.rotary is None:
            raise RuntimeError("init_rotary() must be called before forward()")
        # hidden: [num_tokens, hidden_size]
        hidden = self.model.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        local_rope = rope
        if self.local_rotary is not None:
            local_rope = self.local_rotary.cos_sin(positions, hidden.dtype)
        for index, layer in enumerate(self.model.layers):
            layer_rope = local_rope if self.is_local_rope[index] else rope
            hidden = layer(hidden, layer_rope, kv_cache.layer(index), metadata)
            if on_layer_done is not None:
                on_layer_done(index)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_rows, hidden_size]`` pre-norm hidden states -> ``[num_rows, vocab]`` float32."""
        logits = self.lm_head(self.model.norm(hidden))
        if self.group.world_size > 1:
            # [num_rows, vocab_per_rank] per rank -> [num_rows, vocab]
            logits = self.group.all_gather_last(logits)[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
