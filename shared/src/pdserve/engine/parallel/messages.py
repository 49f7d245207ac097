"""What rank 0 tells the other ranks, over each one's pipe (pickled, in order).

Collectives carry the model's tensors; these messages carry the control: what to load, where
the cache is, and each step's batch. A pipe needs no timeout while the instance is idle, and
its end of file tells a rank that rank 0 is gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.config import EngineConfig


@dataclass(frozen=True)
class Setup:
    """The first message: who the rank is and what it loads.

    Attributes:
        config: The instance's engine settings.
        rank: The receiving rank.
        store_port: The loopback port of rank 0's TCPStore the group forms over.
    """

    config: EngineConfig
    rank: int
    store_port: int


@dataclass(frozen=True)
class Attach:
    """Where the KV cache is, once rank 0 has sized it.

    Attributes:
        num_blocks: Blocks of the cache.
        shared_path: The shared file of all heads (CPU); None: each rank allocates its own
            heads (CUDA).
        window_layers: Sliding-window layers kept in window slots after the blocks in the
            shared file (`pdserve.engine.window_slots`); empty for none.
        num_window_slots: Their slots.
    """

    num_blocks: int
    shared_path: Path | None
    window_layers: tuple[int, ...] = ()
    num_window_slots: int = 0


@dataclass(frozen=True)
class Step:
    """One forward pass, as `ModelRunner.execute_with_positions` takes it.

    Attributes:
        chunks: The batch, as bare chunks (no request).
        every_position: Indices of the chunks whose every position's logits are computed.
        slots: With window slots, the slot of each block of each chunk (0: none), which a
            rank writes into its copy of the slot table before the step.
    """

    chunks: list[ScheduledChunk[None]]
    every_position: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(
        cls,
        chunks: Sequence[ScheduledChunk[Any]],
        every_position: Sequence[int],
        slot_table: torch.Tensor | None = None,
    ) -> Step:
        """The step of a batch of chunks cut from requests (with window slots: the slot of
        each of their blocks, from the cache's `slot_table`)."""
        bare: list[ScheduledChunk[None]] = [
            ScheduledChunk(list(c.token_ids), c.num_computed_tokens, list(c.block_ids))
            for c in chunks
        ]
        slots: tuple[tuple[int, ...], ...] = ()
        if slot_table is not None:
            slots = tuple(tuple(slot_table[c.block_ids].tolist()) for c in bare)
        return cls(bare, tuple(every_position), slots)


@dataclass(frozen=True)
class Shutdown:
    """The last message: the rank exits."""
