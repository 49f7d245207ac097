"""The static inputs a captured decode step reads: allocated once at the largest bucket, filled
in place every step.

A graph replays the kernels it recorded on the same memory, so every input of a decode step
lives in one preallocated tensor per kind and a step's batch is copied into its first rows. The
rows past the batch, up to the bucket, are padding; they must leave the cache as it was:

* a padding row feeds token 0 at position 0 and attends to one key (context length 1): slot 0
  of block 0, which its all-zero table row names (a read of some block, never a write);
* its new K/V are replaced by row 0's before the write, and its slot is row 0's, so the write
  puts row 0's bytes where row 0 puts them (a duplicate index with equal values is exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pdserve.common.generation import num_blocks_for
from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.batch import ScheduledChunk


class StaticDecodeBuffers:
    """Inputs and output of a decode step of at most `max_rows` sequences.

    Args:
        max_rows: Rows of the largest bucket.
        max_blocks_per_seq: Width of the block table: the longest context a graph step
            attends over is ``max_blocks_per_seq * block_size`` tokens.
        block_size: Tokens per KV block.
        vocab_size: Columns of the logits.
        device: Where the buffers live (the model's device).

    Attributes:
        input_ids: ``[max_rows]`` the token each row feeds.
        positions: ``[max_rows]`` its position (its context length less one).
        context_lens: ``[max_rows]`` tokens each row attends to, its new one included.
        block_table: ``[max_rows, max_blocks_per_seq]`` physical block ids, padded with 0.
        slot_mapping: ``[max_rows]`` flat cache slot each row's new K/V is written to.
        write_rows: ``[max_rows]`` whose K/V each row writes (itself, or row 0 for padding).
        logits: ``[max_rows, vocab_size]`` float32 next-token logits of each row.
    """

    def __init__(
        self,
        max_rows: int,
        max_blocks_per_seq: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_rows = max_rows
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = device

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.input_ids = zeros(max_rows)
        self.positions = zeros(max_rows)
        self.context_lens = zeros(max_rows) + 1
        self.block_table = zeros(max_rows, max_blocks_per_seq)
        self.slot_mapping = zeros(max_rows)
        self.write_rows = zeros(max_rows)
        self.logits = torch.zeros(max_rows, vocab_size, dtype=torch.float32, device=device)
        # NOTE: one host-side staging row per input, pinned on CUDA so the copies are async.
        pin = device.type == "cuda"
        self._host_rows = torch.zeros(5, max_rows, dtype=torch.long, pin_memory=pin)
        self._host_table = torch.zeros(
            max_rows, max_blocks_per_seq, dtype=torch.long, pin_memory=pin
        )

    @property
    def max_context_len(self) -> int:
        """The longest context a row can attend over."""
        return self.max_blocks_per_seq * self.block_size

    def fits(self, chunk: ScheduledChunk[Any]) -> bool:
        """Whether `chunk` is a decode whose context fits the block table."""
        return len(chunk.token_ids) == 1 and chunk.num_computed_tokens < self.max_context_len

    def fill(self, chunks: Sequence[ScheduledChunk[Any]], num_rows: int) -> None:
        """Copies `chunks` (decodes that `fit`) into the first rows and pads up to `num_rows`.

        Raises:
            ValueError: If there are more chunks than `num_rows`, or a chunk does not fit or
                has too few blocks.
        """
        if not 0 < len(chunks) <= num_rows <= self.max_rows:
            raise ValueError(f"{len(chunks)} decodes do not fill a bucket of {num_rows} rows")
        block_size, width = self.block_size, self.max_blocks_per_seq
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        table_index: list[int] = []  # flat indices into the table's rows
        table_ids: list[int] = []
        for row, chunk in enumerate(chunks):
            position = chunk.num_computed_tokens
            num_blocks = num_blocks_for(position + 1, block_size)
            if not self.fits(chunk) or len(chunk.block_ids) < num_blocks or position < 0:
                raise ValueError(f"chunk {row} is not a decode this graph step can run")
            block_ids = chunk.block_ids[:num_blocks]
            token_ids.append(chunk.token_ids[0])
            positions.append(position)
            slots.append(block_ids[-1] * block_size + position % block_size)
            table_index.extend(range(row * width, row * width + num_blocks))
            table_ids.extend(block_ids)
        # NOTE: Python lists into one tensor each: per-element writes into a tensor cost
        # microseconds apiece, which at 64 rows would eat what a graph saves.
        num_padding = num_rows - len(chunks)
        # rows: [5, num_rows]: token, position, context length, slot, the row written
        rows = self._host_rows[:, :num_rows]
        rows.copy_(
            torch.tensor(
                [
                    token_ids + [0] * num_padding,
                    positions + [0] * num_padding,
                    [p + 1 for p in positions] + [1] * num_padding,
                    slots + [slots[0]] * num_padding,
                    list(range(len(chunks))) + [0] * num_padding,
                ]
            )
        )
        table = self._host_table[:num_rows]
        table.zero_()
        table.view(-1)[torch.tensor(table_index)] = torch.tensor(table_ids, dtype=torch.long)
        is_async = self.device.type == "cuda"
        for target, source in zip(
            (self.input_ids, self.positions, self.context_lens, self.slot_mapping, self.write_rows),
            rows,
            strict=True,
        ):
            target[:num_rows].copy_(source[:num_rows], non_blocking=is_async)
        self.block_table[:num_rows].copy_(table[:num_rows], non_blocking=is_async)

    def fill_padding(self, num_rows: int) -> None:
        """Makes the first `num_rows` rows padding (before a capture): row 0 writes slot 0."""
        for target, value in (
            (self.input_ids, 0),
            (self.positions, 0),
            (self.context_lens, 1),
            (self.slot_mapping, 0),
            (self.write_rows, 0),
        ):
            target[:num_rows].fill_(value)
        self.block_table[:num_rows].zero_()

    def metadata(self, num_rows: int) -> AttentionMetadata:
        """The attention metadata of a step over the first `num_rows` rows: views of the
        buffers, every row a decode (clear its ``derived`` memo before each eager run)."""
        return AttentionMetadata(
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[:num_rows],
            block_table=self.block_table[:num_rows],
            context_lens=self.context_lens[:num_rows],
            query_lens=torch.ones(num_rows, dtype=torch.long),
            num_decodes=num_rows,
            prefills=[],
            is_static=True,
            write_rows=self.write_rows[:num_rows],
        )
