"""Paged attention over block tables: what every backend shares (`PagedAttention`), and torch
SDPA (`SdpaAttention`, the CPU and default path)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch
import torch.nn.functional as F

import pdserve.engine.cpu_attention as cpu_attention
from pdserve.engine.attention_metadata import AttentionMetadata, DecodeGroup, PrefillSpan


def with_sink(
    mask: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    sink_logits: torch.Tensor,
    key_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDPA's inputs with one sink key after the others: ``(mask, keys, values)``.

    The float mask is 0 where the bool `mask` allows a key, -inf where not, and each head's
    sink logit in the last column; the sink's key and value are zeros. With them (the score
    q.0 is 0, the mask adds the logit), softmax over the keys and the sink, the sink's share
    adding nothing to the output, is gpt-oss's attention with sinks.

    Args:
        mask: Bool, broadcastable to ``[..., num_queries, num_keys]``.
        keys: The keys, ``num_keys`` along `key_dim`.
        values: The values, alike.
        sink_logits: Broadcastable to ``[..., num_queries, 1]`` (the heads in their place).
        key_dim: The keys' (and values') dimension of the keys.
        dtype: The scores' dtype.
    """
    num_keys = keys.shape[key_dim]
    shape = torch.broadcast_shapes(mask.shape, (*sink_logits.shape[:-1], num_keys))
    float_mask = torch.zeros((*shape[:-1], num_keys + 1), dtype=dtype, device=mask.device)
    float_mask[..., :num_keys].masked_fill_(~mask.expand(shape), float("-inf"))
    float_mask[..., num_keys:] = sink_logits.to(dtype)
    pad = [0, 0] * (keys.dim() - 1 - key_dim % keys.dim()) + [0, 1]
    return float_mask, F.pad(keys, pad), F.pad(values, pad)


class PagedKV(NamedTuple):
    """One layer's paged K/V caches as a step sees them: the caches and the step's block tables
    and lengths over them (what a backend reads keys and values through).

    Attributes:
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        v_cache: As ``k_cache``.
        metadata: The step's attention metadata.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata


class PagedAttention(ABC):
    """One layer's attention over the paged KV cache: what every backend shares.

    `forward` writes the step's new K/V into the cache, then attends: a graph step (fixed
    shapes, `AttentionMetadata.is_static`) with `_decode_static`, any other with `_attend`.

    Args:
        num_heads: Query heads (this rank's).
        num_kv_heads: KV heads (this rank's).
        head_dim: Values per head.
        sliding_window: Keys a query sees at most (itself included), or None for all.
        scale: The softmax scale (``head_dim ** -0.5`` by default).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        scale: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.sinks: torch.Tensor | None = None
        """``[num_heads]`` each head's sink logit (gpt-oss), set by the layer; None: no sinks."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Writes the new K/V into the cache, then attends.

        Args:
            q: ``[num_tokens, num_heads, head_dim]``.
            k: ``[num_tokens, num_kv_heads, head_dim]``.
            v: ``[num_tokens, num_kv_heads, head_dim]``.
            k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (same for ``v_cache``).
            v_cache: As ``k_cache``.
            metadata: The step's attention metadata.

        Returns:
            ``[num_tokens, num_heads, head_dim]``.
        """
        metadata.write_kv(k, v, k_cache, v_cache)
        cache = PagedKV(k_cache, v_cache, metadata)
        if metadata.is_static:
            return self._decode_static(q, cache)
        return self._attend(q, k, v, cache)

    @abstractmethod
    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKV
    ) -> torch.Tensor:
        """The step's attention, its K/V already in the cache (`forward`'s arguments)."""

    @abstractmethod
    def _decode_static(self, q: torch.Tensor, cache: PagedKV) -> torch.Tensor:
        """Every decode of a graph step: fixed shapes, no host reads."""


class SdpaAttention(PagedAttention):
    """Attention for one layer with ``torch.nn.functional.scaled_dot_product_attention``.

    Decodes run as one batched call over K/V gathered through their block tables (or, with
    bf16 K/V on a CPU that has AVX512-BF16, on pdserve's kernel straight from the cache,
    `pdserve.engine.cpu_attention`); each prefill chunk runs on its own (on the new K/V directly
    when nothing was cached before it).
    """

    cpu_kernel = True
    """Whether decodes may run on `pdserve.engine.cpu_attention` (batch-invariant attention
    attends its own way)."""

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKV
    ) -> torch.Tensor:
        metadata = cache.metadata
        if not metadata.prefills:
            # NOTE: a step of decodes only (every step of a decode service) returns their
            # attention as computed: no output to allocate and copy into (2.6% of a one-row step).
            return self._decode(q, cache)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if metadata.num_decodes:
            out[: metadata.num_decodes] = self._decode(q[: metadata.num_decodes], cache)
        for span in metadata.prefills:
            out[span.token_start : span.token_end] = self._prefill(span, q, k, v, cache)
        return out

    def _decode(self, q: torch.Tensor, cache: PagedKV) -> torch.Tensor:
        k_cache, v_cache, metadata = cache
        if self.cpu_kernel and cpu_attention.takes(q, k_cache, self.num_kv_heads):
            # NOTE: straight from the cache through the block tables (no gathered copy): a fifth
            # of the gather and SDPA calls' time on a one-row step (`pdserve.engine.cpu_attention`).
            tables, lens = metadata.decode_tables()
            sinks = None if self.sinks is None else self.sinks.float().contiguous()
            return cpu_attention.decode(
                q, k_cache, v_cache, tables, lens, self.scale, self.sliding_window, sinks
            )
        groups = metadata.decode_groups()
        if len(groups) == 1:
            return self._decode_group(groups[0], q, cache)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for group in groups:
            out[group.start : group.end] = self._decode_group(
                group, q[group.start : group.end], cache
            )
        return out

    def _decode_static(self, q: torch.Tensor, cache: PagedKV) -> torch.Tensor:
        """Every decode of a graph step in one call over its whole table width: fixed shapes,
        no host reads (the mask comes from the device's context lengths)."""
        blocks = cache.metadata.block_table.reshape(-1)
        mask = cache.metadata.static_decode_mask(self.sliding_window)
        return self._decode_over_blocks(q, cache, blocks, mask)

    def _decode_over_blocks(
        self, q: torch.Tensor, cache: PagedKV, blocks: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One query token per decode over its blocks (`blocks`: every decode's, the same
        count each, flattened), `mask` marking the keys each one sees."""
        num_decodes = q.shape[0]
        padded_len = blocks.numel() // num_decodes * cache.metadata.block_size
        # NOTE: gathering whole blocks (block_size * num_kv_heads * head_dim contiguous values)
        # is many times faster than gathering token slots one by one.
        # keys, values: [num_decodes, padded_len, num_kv_heads, head_dim]
        shape = (num_decodes, padded_len, self.num_kv_heads, -1)
        keys = cache.k_cache.index_select(0, blocks).view(shape)
        values = cache.v_cache.index_select(0, blocks).view(shape)
        # NOTE: fold the query heads of a GQA group into the query-length axis so that K/V are
        # never repeated: q_grouped: [num_decodes, num_kv_heads, group_size, head_dim]
        q_grouped = q.view(num_decodes, self.num_kv_heads, self.group_size, self.head_dim)
        out = self._grouped_sdpa(q_grouped, keys.transpose(1, 2), values.transpose(1, 2), mask)
        return out.reshape(num_decodes, self.num_heads, self.head_dim)

    def _grouped_sdpa(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """SDPA of queries grouped by KV head (``[batch, num_kv_heads, group_size, head_dim]``)
        over ``[batch, num_kv_heads, num_keys, head_dim]`` keys and values, `mask` a bool
        broadcastable to the scores; with sinks, over one sink key more."""
        if self.sinks is not None:
            logits = self.sinks.view(1, self.num_kv_heads, self.group_size, 1)
            mask, keys, values = with_sink(mask, keys, values, logits, 2, q.dtype)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)

    def _decode_group(self, group: DecodeGroup, q: torch.Tensor, cache: PagedKV) -> torch.Tensor:
        blocks = cache.metadata.decode_blocks(group)
        mask = cache.metadata.decode_mask(group, self.sliding_window)
        return self._decode_over_blocks(q, cache, blocks, mask)

    def _prefill(
        self, span: PrefillSpan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKV
    ) -> torch.Tensor:
        k_cache, v_cache, metadata = cache
        rows = slice(span.token_start, span.token_end)
        # query: [1, num_heads, num_new_tokens, head_dim]
        query = q[rows].transpose(0, 1).unsqueeze(0)
        window = self.sliding_window
        if span.num_computed_tokens == 0:
            keys, values = k[rows], v[rows]
        else:
            blocks = metadata.blocks_of(span.seq_index, span.context_len)
            # keys, values: [context_len, num_kv_heads, head_dim]
            keys, values = metadata.gather_buffer.gather(k_cache, v_cache, blocks)
            keys = keys.flatten(0, 1)[: span.context_len]
            values = values.flatten(0, 1)[: span.context_len]
        # keys, values: [1, num_kv_heads, context_len, head_dim]
        keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        is_plain_causal = (
            span.num_computed_tokens == 0
            and (window is None or span.context_len <= window)
            and self.sinks is None
        )
        mask = None if is_plain_causal else metadata.prefill_mask(span, window)
        if self.sinks is not None:
            assert mask is not None
            logits = self.sinks.view(1, -1, 1, 1)
            mask, keys, values = with_sink(mask, keys, values, logits, 2, query.dtype)
        out = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            is_causal=is_plain_causal,
            scale=self.scale,
            enable_gqa=self.group_size > 1,
        )
        # out: [1, num_heads, num_new_tokens, head_dim] -> [num_new_tokens, num_heads, head_dim]
        return out[0].transpose(0, 1)
