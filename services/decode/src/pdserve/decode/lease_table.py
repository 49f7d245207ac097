"""The lease table: the open leases, how recent ones ended, and the lock every request
transition runs under.

A lease is a `DecodeRequest` in one of its open states; the table holds a reference to each open
one. It is shared by the event loop (AllocateBlocks, SyncCache, ReleaseLease, the expiry sweep)
and the decode thread (admitting committed requests, growing and preempting running ones), so
every method takes one lock. Ownership rule: once a request is RUNNING only the decode thread
ends it, because its blocks may be in use by the forward pass of the current step. A lease that
ends while a transfer still writes into its blocks keeps them until that writer stops
(`end_sync`). Who gets a lease and who may write into it or release it is `leases.LeaseManager`.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import num_blocks_for
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.request import DecodeRequest
from pdserve.decode.sliding_kv import SlidingKV
from pdserve.engine.block_pool import BlockPool

NUM_REMEMBERED_ENDED = 4096


@dataclass(eq=False)
class LeaseTable:
    """The open leases on a `BlockPool`, their transitions, and the block accounting.

    Args:
        pool: The decode's block pool.
        block_size: Tokens per block.
        clock: Monotonic clock (injectable for tests).
        sliding: The window slots of a cache whose sliding layers keep only their window.
    """

    pool: BlockPool
    block_size: int
    clock: Callable[[], float] = time.monotonic
    sliding: SlidingKV | None = None
    lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)
    num_expired: int = field(default=0, init=False)
    _leases: dict[str, DecodeRequest] = field(default_factory=dict, init=False, repr=False)
    _ended: OrderedDict[str, RequestStatus] = field(
        default_factory=OrderedDict, init=False, repr=False
    )
    # NOTE: ended while a transfer was writing into them; freed when the transfer ends.
    _held_for_writer: dict[str, DecodeRequest] = field(default_factory=dict, init=False, repr=False)

    # ---- lookups and transitions -----------------------------------------------------------

    def add(self, lease: DecodeRequest) -> None:
        """Opens `lease` (granted by `leases.LeaseManager.allocate`)."""
        with self.lock:
            self._leases[lease.lease_id] = lease

    def get(self, lease_id: str) -> DecodeRequest:
        """The open request holding lease `lease_id`.

        Raises:
            PdserveError: LEASE_EXPIRED if it expired, LEASE_NOT_FOUND if unknown or ended.
        """
        with self.lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                return lease
            if self._ended.get(lease_id) is RequestStatus.EXPIRED:
                raise PdserveError(
                    ErrorReason.LEASE_EXPIRED, "lease expired", {"leaseId": lease_id}
                )
            raise PdserveError(ErrorReason.LEASE_NOT_FOUND, "no such lease", {"leaseId": lease_id})

    def ended_status(self, lease_id: str) -> RequestStatus | None:
        """The terminal state of a recently ended lease, or None."""
        with self.lock:
            return self._ended.get(lease_id)

    def advance(self, request: DecodeRequest, status: RequestStatus) -> bool:
        """Moves `request` to non-terminal `status` if its state machine allows it now."""
        with self.lock:
            if not request.can_move_to(status):
                return False
            request.move_to(status)
            return True

    def end_sync(self, lease: DecodeRequest) -> None:
        """The transfer into `lease` stopped writing: frees its blocks if it ended meanwhile."""
        with self.lock:
            lease.is_being_written = False
            if self._held_for_writer.pop(lease.lease_id, None) is not None:
                self._free(lease)

    def extend(self, lease: DecodeRequest, num_tokens: int) -> bool:
        """Grows a RUNNING lease's block table to hold `num_tokens`; False if the pool is short."""
        with self.lock:
            missing = num_blocks_for(num_tokens, self.block_size) - len(lease.block_ids)
            if missing <= 0:
                return True
            if not self.pool.can_allocate(missing) or not (
                self.sliding is None or self.sliding.can_grow(missing)
            ):
                return False
            new_blocks = self.pool.allocate(missing)
            lease.block_ids.extend(new_blocks)
            if self.sliding is not None:
                self.sliding.grow(new_blocks)
            return True

    def release_window(self, lease: DecodeRequest) -> None:
        """Lets go of the window slots of a RUNNING lease's blocks its next token is a whole
        window past (after a step; nothing without window slots)."""
        if self.sliding is not None:
            with self.lock:
                self.sliding.release(lease)

    def end(self, request: DecodeRequest, status: RequestStatus) -> bool:
        """Ends `request` in terminal `status` (`DecodeRequest.end` frees its blocks, once) and
        forgets it, remembering how it ended.

        Returns:
            True if this call ended it; False if it had already ended.
        """
        with self.lock:
            is_held = request.is_being_written
            if not request.end(status, None):
                return False
            if is_held:
                self._held_for_writer[request.lease_id] = request
            else:
                self._free(request)
            self._leases.pop(request.lease_id, None)
            self._ended[request.lease_id] = status
            while len(self._ended) > NUM_REMEMBERED_ENDED:
                self._ended.popitem(last=False)
            if status is RequestStatus.EXPIRED:
                self.num_expired += 1
            return True

    def _free(self, lease: DecodeRequest) -> None:
        if self.sliding is not None:
            self.sliding.let_go_all(lease)
        lease.free_blocks(self.pool)

    def due_for_expiry(self) -> list[DecodeRequest]:
        """Open leases past their deadline that were never committed and attached (a
        detached request was attached: its keep time applies instead)."""
        now = self.clock()
        with self.lock:
            return [
                lease
                for lease in self._leases.values()
                if lease.expires_at < now
                and (
                    lease.status < RequestStatus.COMMITTED
                    or not (lease.is_attached or lease.is_detached)
                )
            ]

    # ---- introspection ---------------------------------------------------------------------

    def open_leases(self) -> list[DecodeRequest]:
        with self.lock:
            return list(self._leases.values())

    def num_leased_blocks(self) -> int:
        """Blocks taken by leases that are not running yet (blocks they share with another
        lease are counted there)."""
        with self.lock:
            return sum(
                len(lease.block_ids) - lease.num_shared_blocks
                for lease in self._leases.values()
                if lease.status < RequestStatus.RUNNING
            )

    def check_integrity(self) -> None:
        """Raises AssertionError unless the pool is consistent, every used block is held by
        exactly as many leases as its reference count (a shared prompt block once per lease
        that shares it; a block no lease holds is a leak), and no two leases write into one
        block (a block several leases hold is a shared prompt block of all of them but one)."""
        with self.lock:
            holders = [*self._leases.values(), *self._held_for_writer.values()]
            for lease in holders:
                assert len(set(lease.block_ids)) == len(lease.block_ids), (
                    f"lease {lease.lease_id} holds a block twice"
                )
                assert 0 <= lease.num_shared_blocks <= len(lease.block_ids), (
                    f"lease {lease.lease_id} shares more blocks than it holds"
                )
            writers = Counter(
                b for lease in holders for b in lease.block_ids[lease.num_shared_blocks :]
            )
            twice = [b for b, count in writers.items() if count > 1]
            assert not twice, f"blocks {sorted(twice)} are written by two leases"
            self.pool.check_integrity(Counter(b for lease in holders for b in lease.block_ids))
