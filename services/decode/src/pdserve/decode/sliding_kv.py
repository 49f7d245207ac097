"""Which of a lease's blocks keep the sliding-window layers' KV on this decode.

A decode whose cache keeps its sliding layers' KV only for their window
(`pdserve.engine.window_slots`, ``--release-window-blocks``) holds a window slot for a block
only while its request may still read or write the block in those layers. A lease takes slots
for its blocks from the first one its first decoded token reads (`first_needed`): the blocks
before it are a whole window behind, so the prefill sends those layers' KV only from there on
(``Lease.num_window_skipped_blocks``), and the full-attention layers' KV of every block as
always. Each block the request grows into takes a slot; after each step the blocks its next
token is a window past let theirs go (`release`); its end lets the rest go (`let_go_all`).

Admission counts slots as well as blocks (`refusal`): a lease needs a slot for each of its
window blocks and one for growth, beside one owed to each open lease, else
DECODE_CAPACITY_EXHAUSTED with a retry delay, like a pool short of blocks. Every method runs
under the lease table's lock.
"""

from __future__ import annotations

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.decode.request import DecodeRequest
from pdserve.engine.window_slots import WindowSlots, first_in_window


class SlidingKV:
    """The window slots of the open leases.

    Args:
        slots: The cache's window slots.
        window: The model's widest sliding window (tokens).
        block_size: Tokens per block.
    """

    def __init__(self, slots: WindowSlots, window: int, block_size: int) -> None:
        self.slots = slots
        self.window = window
        self.block_size = block_size

    def first_needed(self, num_tokens: int) -> int:
        """The first block whose sliding KV a request with `num_tokens` of KV still reads (its
        next token's position is `num_tokens`)."""
        return first_in_window(num_tokens, self.window, self.block_size)

    def num_needed(self, num_kv_tokens: int, num_blocks: int) -> int:
        """Slots a new lease of `num_blocks` blocks for `num_kv_tokens` of KV takes, and one
        for its first new block."""
        return max(0, num_blocks - self.first_needed(num_kv_tokens)) + 1

    def refusal(
        self,
        request_id: str,
        num_kv_tokens: int,
        num_blocks: int,
        num_open_leases: int,
        retry_delay_s: float,
    ) -> PdserveError | None:
        """DECODE_CAPACITY_EXHAUSTED (with a retry delay) when the free slots do not cover a
        new lease's window blocks and its growth, beside one slot owed to each of the
        `num_open_leases` (a request crossing into a new block takes its slot before the step
        after lets the oldest go); else None."""
        needed = self.num_needed(num_kv_tokens, num_blocks)
        available = self.slots.num_free - num_open_leases
        if needed <= available:
            return None
        return PdserveError(
            ErrorReason.DECODE_CAPACITY_EXHAUSTED,
            f"needs {needed} window slots for its sliding layers, {max(0, available)} available "
            f"({self.slots.num_free} free, {num_open_leases} owed to open leases)",
            {"requestId": request_id, "numBlocks": str(num_blocks)},
            retry_delay_s=retry_delay_s,
        )

    def grant(self, lease: DecodeRequest) -> None:
        """Holds the slots of a new lease's blocks from the first it reads on; the blocks
        before count as let go (``num_window_released``: the sender skips them)."""
        first = min(self.first_needed(lease.num_kv_tokens), len(lease.block_ids))
        self.slots.hold(lease.block_ids[first:])
        lease.num_window_released = first

    def can_grow(self, num_blocks: int) -> bool:
        """Whether `num_blocks` new blocks can take slots."""
        return num_blocks <= self.slots.num_free

    def grow(self, block_ids: list[int]) -> None:
        """Holds the slots of blocks a running request just took."""
        self.slots.hold(block_ids)

    def release(self, lease: DecodeRequest) -> None:
        """Lets go of the slots of the blocks the request's next token (and every later one)
        is a whole window past."""
        first = min(self.first_needed(lease.num_computed_tokens), len(lease.block_ids))
        if first > lease.num_window_released:
            self.slots.let_go(lease.block_ids[lease.num_window_released : first])
            lease.num_window_released = first

    def let_go_all(self, lease: DecodeRequest) -> None:
        """Lets go of every slot the lease holds (it is freeing its blocks)."""
        self.slots.let_go(lease.block_ids[lease.num_window_released :])
        lease.num_window_released = len(lease.block_ids)
