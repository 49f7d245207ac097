"""Where a cache's sliding-window layers keep their KV: a smaller pool of slots that follows
the window, instead of a copy of every block.

A sliding layer attends to its last ``window`` keys only, so a block that every holder has
moved past by a window is never read by those layers again. In a cache built with window slots
(`pdserve.engine.kv_cache.KVCache`, ``window_layers``), the full-attention layers keep one
block per block id, as every cache does, and the sliding layers keep their K/V in slots: a
block id is *held* (mapped to a slot) while some sequence may still read or write its sliding
KV, and let go after. A let-go slot keeps its block's KV until the slot is taken again (least
recently let go first), so a prefix-cache hit can still find it; `is_mapped` says whether it
does. The block table stays one per sequence: the sliding layers read it through
`slot_table` (an unmapped block reads slot 0, which the window's mask never lets through).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch


def first_in_window(position: int, window: int, block_size: int) -> int:
    """The first block that a query at `position` (and every later one) may read in a sliding
    layer of `window` keys: the blocks before it are a whole window behind."""
    return max(0, position - window + 1) // block_size


class WindowSlots:
    """Maps block ids to the sliding layers' slots, with a reference count per held slot.

    Args:
        num_slots: Slots of the sliding layers' storage.
        num_blocks: Block ids of the cache (``0 .. num_blocks - 1``).
        device: Where `slot_table` lives (the cache's device).
    """

    def __init__(self, num_slots: int, num_blocks: int, device: torch.device) -> None:
        if num_slots <= 0:
            raise ValueError(f"window slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of = [-1] * num_blocks
        self._block_of = [-1] * num_slots
        self._refs = [0] * num_slots
        # NOTE: free slots, least recently let go first; a free slot may still be mapped.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        self.slot_table = torch.zeros(num_blocks, dtype=torch.long, device=device)
        """``[num_blocks]`` the slot of each block id (0 for an unmapped one)."""

    @property
    def num_free(self) -> int:
        """Slots no sequence holds (mapped to a block or not)."""
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Slots at least one sequence holds."""
        return self.num_slots - len(self._free)

    def is_mapped(self, block_id: int) -> bool:
        """Whether `block_id`'s sliding KV is in a slot (held, or let go and not yet reused)."""
        return self._slot_of[block_id] >= 0

    def is_held(self, block_id: int) -> bool:
        """Whether some sequence holds `block_id`'s slot."""
        slot = self._slot_of[block_id]
        return slot >= 0 and self._refs[slot] > 0

    def slot_of(self, block_id: int) -> int:
        """The slot of a mapped block.

        Raises:
            KeyError: The block has no slot.
        """
        slot = self._slot_of[block_id]
        if slot < 0:
            raise KeyError(f"block {block_id} has no window slot")
        return slot

    def num_to_take(self, block_ids: Iterable[int]) -> int:
        """Free slots that `hold(block_ids)` would take (a held or mapped block takes none
        from other blocks; an unmapped one takes the least recently let go)."""
        return sum(1 for b in set(block_ids) if not self.is_held(b))

    def hold(self, block_ids: Iterable[int]) -> None:
        """Takes a reference on each block's slot, mapping a slot to each unmapped block
        (the least recently let go: the block it held loses its sliding KV).

        Raises:
            ValueError: Fewer free slots than `num_to_take` says are needed (nothing changes).
        """
        block_ids = list(block_ids)
        needed = self.num_to_take(block_ids)
        if needed > len(self._free):
            raise ValueError(f"{needed} window slots needed, {len(self._free)} free")
        for block_id in block_ids:
            slot = self._slot_of[block_id]
            if slot < 0:
                slot, _ = self._free.popitem(last=False)
                self._unmap(slot)
                self._slot_of[block_id] = slot
                self._block_of[slot] = block_id
                self.slot_table[block_id] = slot
            elif self._refs[slot] == 0:
                del self._free[slot]
            self._refs[slot] += 1

    def let_go(self, block_ids: Iterable[int]) -> None:
        """Drops a reference from each block's slot; a slot none holds becomes free (its KV
        stays until the slot is taken again).

        Raises:
            ValueError: A block whose slot is not held.
        """
        for block_id in block_ids:
            slot = self._slot_of[block_id]
            if slot < 0 or self._refs[slot] == 0:
                raise ValueError(f"block {block_id}'s window slot is not held")
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                self._free[slot] = None

    def forget(self, block_id: int) -> None:
        """Unmaps a block whose slot no one holds (its id is about to hold other tokens)."""
        slot = self._slot_of[block_id]
        if slot >= 0 and self._refs[slot] == 0:
            self._unmap(slot)
            # NOTE: an unmapped free slot is the next to be taken.
            self._free.move_to_end(slot, last=False)

    def _unmap(self, slot: int) -> None:
        block_id = self._block_of[slot]
        if block_id >= 0:
            self._slot_of[block_id] = -1
            self.slot_table[block_id] = 0
            self._block_of[slot] = -1
