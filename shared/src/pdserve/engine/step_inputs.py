"""One eager step's model inputs: the batch flattened into token rows and its attention metadata,
built on the host once per step and moved to the device before the forward runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pdserve.common.generation import num_blocks_for
from pdserve.engine.attention_buffer import KVGatherBuffer
from pdserve.engine.attention_metadata import AttentionMetadata, PrefillSpan
from pdserve.engine.batch import ScheduledChunk


class StepInputs(NamedTuple):
    """What the model's forward takes for one step.

    Attributes:
        input_ids: ``[num_tokens]`` token ids of every chunk, concatenated (on the device).
        positions: ``[num_tokens]`` position of each token in its sequence (on the device).
        metadata: Block tables, slots and sequence boundaries.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata


def prepare_step(
    chunks: Sequence[ScheduledChunk[Any]],
    block_size: int,
    device: torch.device,
    gather_buffer: KVGatherBuffer,
) -> StepInputs:
    """Flattens `chunks` (decodes first) into a step's inputs.

    Raises:
        ValueError: If a chunk is empty, starts before 0 or has too few blocks.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    seq_index: list[int] = []
    tables: list[Sequence[int]] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    prefills: list[PrefillSpan] = []
    num_decodes = 0
    for index, chunk in enumerate(chunks):
        num_new = len(chunk.token_ids)
        start = chunk.num_computed_tokens
        context_len = start + num_new
        num_blocks = num_blocks_for(context_len, block_size)
        if num_new == 0 or start < 0 or len(chunk.block_ids) < num_blocks:
            raise ValueError(
                f"chunk {index}: {num_new} new tokens at position {start} need "
                f"{num_blocks} blocks, got {len(chunk.block_ids)}"
            )
        if num_new == 1:
            num_decodes += 1
        else:
            prefills.append(PrefillSpan(index, len(input_ids), len(input_ids) + num_new, start))
        input_ids.extend(chunk.token_ids)
        positions.extend(range(start, context_len))
        seq_index.extend([index] * num_new)
        tables.append(chunk.block_ids[:num_blocks])
        query_lens.append(num_new)
        context_lens.append(context_len)
    max_blocks = max(len(t) for t in tables)
    # block_table: [num_seqs, max_blocks], padded with block 0 (never read past a context)
    block_table = torch.tensor([list(t) + [0] * (max_blocks - len(t)) for t in tables])
    positions_t = torch.tensor(positions)
    seq_index_t = torch.tensor(seq_index)
    # slot_mapping: [num_tokens]
    slot_mapping = (
        block_table[seq_index_t, positions_t // block_size] * block_size + positions_t % block_size
    )
    # NOTE: every tensor the layers read goes to the device here, before the forward: no layer
    # copies from the host (a copy from pageable memory waits for the device).
    lens = torch.tensor([query_lens, context_lens])
    metadata = AttentionMetadata(
        block_size=block_size,
        slot_mapping=slot_mapping.to(device),
        block_table=block_table.to(device),
        context_lens=lens[1],
        query_lens=lens[0],
        num_decodes=num_decodes,
        prefills=prefills,
        gather_buffer=gather_buffer,
        device_lens=lens.to(device) if device.type != "cpu" else None,
    )
    return StepInputs(torch.tensor(input_ids, device=device), positions_t.to(device), metadata)
