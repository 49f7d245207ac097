"""The decoder of every family over a paged KV cache.

Most families share one layer shape (`pdserve.engine.decoder.LlamaDecoderLayer`); a family with
a layer of its own names it in its module (`pdserve.engine.families`, `Family.decoder_layer`:
Gemma 3's norms after each block too, OLMo 2's after each block only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.decoder import LlamaDecoderLayer
from pdserve.engine.families import family_of
from pdserve.engine.fused_decode import FusedDecode
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.layers import RMSNorm, make_norm
from pdserve.engine.linear import Linear, can_pack_for_onednn
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.layers import VocabParallelEmbedding, check_model_fits
from pdserve.engine.rope import RotaryEmbedding

__all__ = ["LayerCallback", "Linear", "LlamaForCausalLM", "RMSNorm", "can_pack_for_onednn"]

LayerCallback = Callable[[int], None]


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: ModelConfig, backend: str, group: TensorParallelGroup) -> None:
        super().__init__()
        layer_cls: type[nn.Module] = family_of(config.model_type).decoder_layer or LlamaDecoderLayer
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, group)
            if group.world_size > 1
            # NOTE: an empty weight, not nn.Embedding's random one: the loader builds the model
            # on the meta device and fills every parameter, and a random init there runs
            # through torch's Python reference ops (~1.4 s of every instance's start).
            else nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size),
            )
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
        self._fused: FusedDecode | None = None
        self._is_fused_checked = False

    def tie_weights(self) -> None:
        """Shares the embedding matrix with the LM head when the config says so (after loading).

        The LM head gets the contiguous ``[hidden, vocab]`` copy and the embedding becomes a
        transposed view of it, so the matrix is stored once.
        """
        if not self.config.tie_word_embeddings or not isinstance(self.lm_head, Linear):
            # NOTE: a kept int8 LM head (`pdserve.engine.quant.Int8GroupLinear`) already
            # shares its tensors with the embedding.
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

    def fused_decode(self) -> FusedDecode | None:
        """The compiled float32 decode step over this model's layers
        (`pdserve.engine.fused_decode`), decided at the first forward (after loading,
        quantization, packing and `--deterministic` have set the layers up); None where they
        do not fuse."""
        if not self._is_fused_checked:
            self._is_fused_checked = True
            self._fused = FusedDecode.for_model(self)
        return self._fused

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
        # NOTE: ERNIE 4.5 rotates in float32 (its reference does): the same bits in bf16.
        rope_dtype = torch.float32 if self.config.is_rope_interleaved else hidden.dtype
        rope = self.rotary.cos_sin(positions, rope_dtype)
        local_rope = rope
        if self.local_rotary is not None:
            local_rope = self.local_rotary.cos_sin(positions, rope_dtype)
        fused = self.fused_decode()
        if fused is not None and on_layer_done is None and fused.takes(hidden, kv_cache, metadata):
            return fused.run(hidden, rope, kv_cache, metadata)
        # NOTE: a cache whose sliding layers keep only their window reads them through slots.
        slots = kv_cache.window_slots
        window_metadata = metadata if slots is None else metadata.through(slots.slot_table)
        for index, layer in enumerate(self.model.layers):
            layer_rope: tuple[torch.Tensor, torch.Tensor] | None = (
                local_rope if self.is_local_rope[index] else rope
            )
            if not self.config.is_rope_layer(index):
                layer_rope = None
            layer_metadata = window_metadata if kv_cache.is_window_layer(index) else metadata
            hidden = layer(hidden, layer_rope, kv_cache.layer(index), layer_metadata)
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
