"""Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import SdpaAttention
from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.flash_attention import FlashAttention
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.rope import RotaryEmbedding, apply_rotary

LayerCallback = Callable[[int], None]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like the reference."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


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
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_weight: torch.Tensor | None = None

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
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v projection, rotary embeddings and GQA."""

    def __init__(self, config: ModelConfig, layer_index: int, backend: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias)
        attention_cls = FlashAttention if backend == "flash" else SdpaAttention
        self.attn = attention_cls(
            self.num_heads, self.num_kv_heads, self.head_dim, config.sliding_window(layer_index)
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # qkv: [num_tokens, q_size + 2 * kv_size]
        qkv = self.qkv_proj(hidden)
        # NOTE: q and k are rotated together in one pass.
        # qk: [num_tokens, num_heads + num_kv_heads, head_dim]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        # out: [num_tokens, num_heads, head_dim]
        out = self.attn.forward(q, k, v, kv_cache[0], kv_cache[1], metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up: [num_tokens, 2 * intermediate_size]
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block followed by a pre-norm MLP block."""

    def __init__(self, config: ModelConfig, layer_index: int, backend: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, backend: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The causal LM: parameter names follow Hugging Face's except for the fused projections.

    Args:
        config: The architecture.
        attention_backend: ``sdpa`` or ``flash`` (already resolved for the device).
    """

    def __init__(self, config: ModelConfig, attention_backend: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        self.attention_backend = attention_backend
        self.model = LlamaModel(config, attention_backend)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

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
        self.rotary = RotaryEmbedding(self.config.rope, self.config.head_dim, device)

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
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        for index, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin, kv_cache.layer(index), metadata)
            if on_layer_done is not None:
                on_layer_done(index)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[num_rows, hidden_size]`` pre-norm hidden states -> ``[num_rows, vocab]`` float32."""
        return self.lm_head(self.model.norm(hidden)).float()
