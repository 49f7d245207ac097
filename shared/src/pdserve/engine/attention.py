"""Paged attention over block tables with torch SDPA (the CPU and default path)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


class KVGatherBuffer:
    """Reusable destination for K/V gathered through block tables.

    NOTE: a fresh multi-megabyte tensor per layer and step is mapped anew by the allocator and
    page-faulted on first write, which on CPU costs about as much as the copy itself.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies the given blocks of one layer; valid until the next ``gather``.

        Returns:
            ``(k, v)``, each ``[len(block_ids), block_size, num_kv_heads, head_dim]``.
        """
        num_blocks = block_ids.numel()
        if (
            not self._buffers
            or self._buffers[0].shape[0] < num_blocks
            or (
                self._buffers[0].dtype != k_cache.dtype or self._buffers[0].device != k_cache.device
            )
        ):
            # Grow with headroom so that slowly growing contexts do not reallocate every step.
            capacity = max(num_blocks + num_blocks // 4, 16)
            shape = (capacity, *k_cache.shape[1:])
            self._buffers = [
                torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device) for _ in range(2)
            ]
        k_out, v_out = (buffer[:num_blocks] for buffer in self._buffers)
        torch.index_select(k_cache, 0, block_ids, out=k_out)
        torch.index_select(v_cache, 0, block_ids, out=v_out)
        return k_out, v_out


@dataclass
class PrefillSpan:
    """One sequence with several new tokens in a batch.

    Attributes:
        seq_index: Row of the sequence in ``AttentionMetadata.block_table``.
        token_start: First row of the sequence's tokens in the flattened batch.
        token_end: One past its last row.
        num_computed_tokens: Tokens already in the cache before this chunk (its start position).
    """

    seq_index: int
    token_start: int
    token_end: int
    num_computed_tokens: int

    @property
    def num_new_tokens(self) -> int:
        """Tokens of this chunk."""
        return self.token_end - self.token_start

    @property
    def context_len(self) -> int:
        """Tokens attended to by the last new token (cached plus new)."""
        return self.num_computed_tokens + self.num_new_tokens


@dataclass
class AttentionMetadata:
    """Per-step inputs shared by all layers.

    Sequences with exactly one new token ("decodes") come first in the batch, one token each;
    the remaining sequences are ``prefills``.

    Attributes:
        block_size: Tokens per block.
        slot_mapping: ``[num_tokens]`` flat cache slot (``block_id * block_size + offset``) of each
            new token.
        block_table: ``[num_seqs, max_num_blocks]`` physical block ids, padded with 0.
        context_lens: ``[num_seqs]`` cached plus new tokens per sequence (CPU tensor).
        query_lens: ``[num_seqs]`` new tokens per sequence (CPU tensor).
        num_decodes: Leading sequences (and tokens) with one new token.
        decode_max_len: Longest context among the decodes (0 without decodes).
        prefills: The other sequences.
        gather_buffer: Where K/V gathered for attention are copied (reused across steps).
        derived: Memo of tensors derived from the above (masks, gathers), shared by all layers.
    """

    block_size: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    num_decodes: int
    decode_max_len: int
    prefills: list[PrefillSpan]
    gather_buffer: KVGatherBuffer = field(default_factory=KVGatherBuffer)
    derived: dict[object, Any] = field(default_factory=dict)

    def blocks_of(self, seq_index: int, num_tokens: int) -> torch.Tensor:
        """``[num_blocks]`` physical ids of the blocks holding a sequence's first ``num_tokens``."""
        return self.block_table[seq_index, : -(-num_tokens // self.block_size)]

    @property
    def decode_padded_len(self) -> int:
        """Decode context length padded to whole blocks (the key length of the decode batch)."""
        return -(-self.decode_max_len // self.block_size) * self.block_size

    def decode_blocks(self) -> torch.Tensor:
        """``[num_decodes * num_blocks]`` block ids of every decode's context, row-major."""
        key = "decode_blocks"
        if key not in self.derived:
            num_blocks = self.decode_padded_len // self.block_size
            self.derived[key] = self.block_table[: self.num_decodes, :num_blocks].reshape(-1)
        return self.derived[key]

    def decode_mask(self, window: int | None) -> torch.Tensor:
        """``[num_decodes, 1, 1, padded_len]`` bool mask of the keys each decode may attend to."""
        key = ("decode_mask", window)
        if key not in self.derived:
            max_len = self.decode_padded_len
            lens = self.context_lens[: self.num_decodes].to(self.block_table.device)[:, None]
            key_pos = torch.arange(max_len, device=self.block_table.device)[None, :]
            mask = key_pos < lens
            if window is not None:
                mask &= key_pos > lens - 1 - window
            self.derived[key] = mask[:, None, None, :]
        return self.derived[key]

    def prefill_mask(self, span: PrefillSpan, window: int | None) -> torch.Tensor:
        """``[num_new_tokens, context_len]`` bool causal (and sliding-window) mask of a chunk."""
        key = ("prefill_mask", span.seq_index, window)
        if key not in self.derived:
            device = self.block_table.device
            query_pos = torch.arange(span.num_computed_tokens, span.context_len, device=device)
            key_pos = torch.arange(span.context_len, device=device)
            mask = key_pos[None, :] <= query_pos[:, None]
            if window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - window
            self.derived[key] = mask
        return self.derived[key]


class SdpaAttention:
    """Attention for one layer with ``torch.nn.functional.scaled_dot_product_attention``.

    Decodes run as one batched call over K/V gathered through their block tables; each prefill
    chunk runs on its own (on the new K/V directly when nothing was cached before it).
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

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
        # The cache seen as token slots: [num_blocks * block_size, num_kv_heads, head_dim]
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, metadata.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, metadata.slot_mapping, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if metadata.num_decodes:
            out[: metadata.num_decodes] = self._decode(
                q[: metadata.num_decodes], k_cache, v_cache, metadata
            )
        for span in metadata.prefills:
            out[span.token_start : span.token_end] = self._prefill(
                span, q, k, v, k_cache, v_cache, metadata
            )
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_decodes = q.shape[0]
        blocks = metadata.decode_blocks()
        padded_len = metadata.decode_padded_len
        # NOTE: gathering whole blocks (block_size * num_kv_heads * head_dim contiguous values)
        # is many times faster than gathering token slots one by one.
        # keys, values: [num_decodes, padded_len, num_kv_heads, head_dim]
        keys = k_cache.index_select(0, blocks).view(num_decodes, padded_len, self.num_kv_heads, -1)
        values = v_cache.index_select(0, blocks).view(
            num_decodes, padded_len, self.num_kv_heads, -1
        )
        # NOTE: fold the query heads of a GQA group into the query-length axis so that K/V are
        # never repeated: q_grouped: [num_decodes, num_kv_heads, group_size, head_dim]
        q_grouped = q.view(num_decodes, self.num_kv_heads, self.group_size, self.head_dim)
        out = F.scaled_dot_product_attention(
            q_grouped,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=metadata.decode_mask(self.sliding_window),
            scale=self.scale,
        )
        return out.reshape(num_decodes, self.num_heads, self.head_dim)

    def _prefill(
        self,
        span: PrefillSpan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
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
        is_plain_causal = span.num_computed_tokens == 0 and (
            window is None or span.context_len <= window
        )
        out = F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=None if is_plain_causal else metadata.prefill_mask(span, window),
            is_causal=is_plain_causal,
            scale=self.scale,
            enable_gqa=self.group_size > 1,
        )
        # out: [1, num_heads, num_new_tokens, head_dim] -> [num_new_tokens, num_heads, head_dim]
        return out[0].transpose(0, 1)
