"""Per-step attention inputs: sequence boundaries, block tables, masks, decode groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch

from pdserve.common.generation import num_blocks_for
from pdserve.engine.attention_buffer import KVGatherBuffer


class DecodeGroup(NamedTuple):
    """Decodes ``start .. end - 1`` whose contexts are gathered and attended together.

    Attributes:
        start: First decode (sequence and token row) of the group.
        end: One past the last.
        num_blocks: Blocks per sequence gathered for the group (its longest context).
    """

    start: int
    end: int
    num_blocks: int


# NOTE: one more attention call costs about as much as gathering and attending ~8 extra
# padding blocks, so a new group pays off only when it saves more padding than that.
_GROUP_OVERHEAD_BLOCKS = 8
# NOTE: a few sequences per call keep the gathered K/V in cache while SDPA reads them (measured
# on CPU: groups of 4-8 decodes attend 25-30% faster than one call over 32).
_MAX_GROUP_SIZE = 8


def split_decode_groups(context_lens: Sequence[int], block_size: int) -> list[DecodeGroup]:
    """Splits decodes sorted by context length into groups that minimise padded work.

    Args:
        context_lens: Context length of each decode, ascending.
        block_size: Tokens per block.

    Returns:
        Consecutive groups covering every decode; each is padded to its own longest context.
    """
    num_blocks = [num_blocks_for(n, block_size) for n in context_lens]
    count = len(num_blocks)
    if count == 0:
        return []
    # best[i]: least cost of grouping the first i decodes; cut[i]: where its last group starts.
    best = [0] + [0] * count
    cut = [0] * (count + 1)
    for end in range(1, count + 1):
        best[end], cut[end] = min(
            (best[start] + (end - start) * num_blocks[end - 1] + _GROUP_OVERHEAD_BLOCKS, start)
            for start in range(max(0, end - _MAX_GROUP_SIZE), end)
        )
    groups = []
    end = count
    while end > 0:
        start = cut[end]
        groups.append(DecodeGroup(start, end, num_blocks[end - 1]))
        end = start
    return groups[::-1]


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
        context_lens: ``[num_seqs]`` cached plus new tokens per sequence (CPU tensor; on the
            device on a graph step).
        query_lens: ``[num_seqs]`` new tokens per sequence (CPU tensor).
        num_decodes: Leading sequences (and tokens) with one new token, sorted by context length.
        prefills: The other sequences.
        gather_buffer: Where K/V gathered for attention are copied (reused across steps).
        is_static: A graph step (`pdserve.engine.graphs`): every sequence is a decode,
            ``context_lens`` is on the device, and nothing may read a tensor on the host.
        device_lens: ``[2, num_seqs]`` ``query_lens`` and ``context_lens`` on the device,
            copied once before the forward (None: layers copy what they need).
        write_rows: ``[num_tokens]`` on a graph step, the row whose new K/V each row writes
            (padding rows write row 0's, into row 0's slot); None otherwise.
        derived: Memo of tensors derived from the above (masks, gathers), shared by all layers.
    """

    block_size: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    num_decodes: int
    prefills: list[PrefillSpan]
    gather_buffer: KVGatherBuffer = field(default_factory=KVGatherBuffer)
    is_static: bool = False
    device_lens: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None
    derived: dict[object, Any] = field(default_factory=dict)

    def through(self, slot_table: torch.Tensor) -> AttentionMetadata:
        """The same step read through a cache's window slots (`pdserve.engine.window_slots`):
        block tables and slots of the slot each block id maps to, memos of their own."""
        # NOTE: an id without a slot reads slot 0: outside every window, masked.
        slots = slot_table[self.slot_mapping // self.block_size]
        return replace(
            self,
            block_table=slot_table[self.block_table],
            slot_mapping=slots * self.block_size + self.slot_mapping % self.block_size,
            derived={},
        )

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """Writes the step's new K/V (``[num_tokens, num_kv_heads, head_dim]``) into one layer's
        cache (``[num_blocks, block_size, num_kv_heads, head_dim]``) at ``slot_mapping``."""
        if self.write_rows is not None:
            # NOTE: a padding row's slot is row 0's; giving it row 0's K/V makes the duplicate
            # write exact, whatever its own (meaningless) K/V were.
            k, v = k.index_select(0, self.write_rows), v.index_select(0, self.write_rows)
        k_cache.view(-1, *k.shape[1:]).index_copy_(0, self.slot_mapping, k)
        v_cache.view(-1, *v.shape[1:]).index_copy_(0, self.slot_mapping, v)

    def static_decode_mask(self, window: int | None) -> torch.Tensor:
        """``[num_seqs, 1, 1, table width * block_size]`` bool mask of the keys each decode of
        a graph step may attend to, computed on the device from ``context_lens``."""
        key = ("static_decode_mask", window)
        if key not in self.derived:
            width = self.block_table.shape[1] * self.block_size
            lens = self.context_lens[:, None]
            key_pos = torch.arange(width, device=self.block_table.device)[None, :]
            mask = key_pos < lens
            if window is not None:
                mask &= key_pos > lens - 1 - window
            self.derived[key] = mask[:, None, None, :]
        return self.derived[key]

    def blocks_of(self, seq_index: int, num_tokens: int) -> torch.Tensor:
        """``[num_blocks]`` physical ids of the blocks holding a sequence's first ``num_tokens``."""
        return self.block_table[seq_index, : num_blocks_for(num_tokens, self.block_size)]

    def decode_groups(self) -> list[DecodeGroup]:
        """The decodes split into runs of similar context length (see ``split_decode_groups``)."""
        key = "decode_groups"
        if key not in self.derived:
            lens = self.context_lens[: self.num_decodes].tolist()
            self.derived[key] = split_decode_groups(lens, self.block_size)
        return self.derived[key]

    def decode_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' block tables (``[num_decodes, width]``) and context lengths
        (``[num_decodes]``), both int32 and contiguous (`pdserve.engine.cpu_attention`)."""
        key = "decode_tables"
        if key not in self.derived:
            tables = self.block_table[: self.num_decodes].to(torch.int32).contiguous()
            lens = self.context_lens[: self.num_decodes].to(torch.int32).contiguous()
            self.derived[key] = (tables, lens)
        return self.derived[key]

    def decode_blocks(self, group: DecodeGroup) -> torch.Tensor:
        """``[group size * group.num_blocks]`` block ids of a decode group's contexts, row-major."""
        key = ("decode_blocks", group.start)
        if key not in self.derived:
            table = self.block_table[group.start : group.end, : group.num_blocks]
            self.derived[key] = table.reshape(-1)
        return self.derived[key]

    def decode_mask(self, group: DecodeGroup, window: int | None) -> torch.Tensor:
        """``[group size, 1, 1, padded_len]`` bool mask of the keys each decode may attend to."""
        key = ("decode_mask", group.start, window)
        if key not in self.derived:
            device = self.block_table.device
            context_lens = self.context_lens if self.device_lens is None else self.device_lens[1]
            lens = context_lens[group.start : group.end].to(device)[:, None]
            key_pos = torch.arange(group.num_blocks * self.block_size, device=device)[None, :]
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
