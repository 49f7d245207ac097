"""The lease table: admission with headroom, and the lock every request transition runs under.

A lease is a `DecodeRequest` in one of its open states; the table holds a reference to each open
one. It is shared by the event loop (AllocateBlocks, SyncCache, ReleaseLease, the expiry sweep)
and the decode thread (admitting committed requests, growing and preempting running ones), so
every method takes one lock. Ownership rule: once a request is RUNNING only the decode thread
ends it, because its blocks may be in use by the forward pass of the current step. The
admission arithmetic (headroom, capacity, per-peer share) is pure, in `lease_admission`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import num_blocks_for
from pdserve.common.pki import Identity
from pdserve.decode import lease_access
from pdserve.decode.lease_admission import (
    RecentAsks,
    capacity_refusal,
    lease_size,
    length_refusal,
    num_owed_blocks,
    share_refusal,
)
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.request import DecodeRequest
from pdserve.engine.block_pool import BlockPool

NUM_REMEMBERED_ENDED = 4096


class LeaseManager:
    """Grants leases (new `DecodeRequest`s) from a `BlockPool`; runs their transitions.

    Args:
        pool: The decode's block pool.
        block_size: Tokens per block.
        reserve_tokens: Growth headroom per running request, in tokens.
        ttl_s: Lease lifetime until commit and attach.
        capacity_retry_s: Retry delay sent with DECODE_CAPACITY_EXHAUSTED.
        clock: Monotonic clock (injectable for tests).
        max_model_len: Longest sequence (KV plus new tokens) a lease may be for.
        max_lease_share: Fraction of the pool one peer may hold in uncommitted leases while
            other peers ask for blocks too (a peer's only uncommitted lease is never refused
            for it).
        is_insecure: Whether the plane is plaintext (callers have no certified identity; the
            weaker rules of `lease_access` apply).
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        reserve_tokens: int,
        ttl_s: float,
        capacity_retry_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_model_len: int | None = None,
        max_lease_share: float = 1.0,
        is_insecure: bool = False,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.reserve_tokens = reserve_tokens
        self.ttl_s = ttl_s
        self.capacity_retry_s = capacity_retry_s
        self.clock = clock
        self._asks = RecentAsks()
        self.max_model_len = max_model_len
        self.max_lease_share = max_lease_share
        self.is_insecure = is_insecure
        self.lock = threading.RLock()
        self.is_draining = False
        self.num_expired = 0
        self.num_granted = 0
        self.num_refused = 0
        self.num_access_refused = 0
        self._leases: dict[str, DecodeRequest] = {}
        self._ended: OrderedDict[str, RequestStatus] = OrderedDict()
        # NOTE: ended while a transfer was writing into them; freed when the transfer ends.
        self._held_for_writer: dict[str, DecodeRequest] = {}

    # ---- admission -------------------------------------------------------------------------

    def num_reserved_blocks(self) -> int:
        """Free blocks owed to open leases as growth headroom."""
        with self.lock:
            return num_owed_blocks(
                self._leases.values(),
                reserve_tokens=self.reserve_tokens,
                block_size=self.block_size,
            )

    def num_uncommitted_blocks(self, peer_key: str) -> int:
        """Blocks that `peer_key`'s leases hold before their commit (ALLOCATED, SYNCING)."""
        with self.lock:
            return sum(
                len(lease.block_ids)
                for lease in self._leases.values()
                if lease.peer_key == peer_key and lease.status < RequestStatus.COMMITTED
            )

    def allocate(
        self,
        request_id: str,
        num_kv_tokens: int,
        max_new_tokens: int,
        *,
        caller: Identity | None = None,
        prefill_instance_id: str = "",
    ) -> DecodeRequest:
        """Grants a lease (with a fresh token) for `num_kv_tokens` of KV, keeping headroom for
        running requests and within the share of the pool the calling peer may hold
        uncommitted (`caller`: its certified identity; `prefill_instance_id`: the id it states).

        Raises:
            PdserveError: INSTANCE_DRAINING; INVALID_REQUEST; PROMPT_TOO_LONG past
                ``max_model_len``; DECODE_CAPACITY_EXHAUSTED (with a retry delay) when free
                blocks minus owed headroom do not cover the prompt and its own headroom, or
                when a peer already holding uncommitted leases would exceed its share.
        """
        refusal = length_refusal(request_id, num_kv_tokens, max_new_tokens, self.max_model_len)
        if refusal is not None:
            raise refusal
        size = lease_size(num_kv_tokens, max_new_tokens, self.reserve_tokens, self.block_size)
        peer_key = lease_access.peer_key(caller, prefill_instance_id)
        with self.lock:
            if self.is_draining:
                raise PdserveError(
                    ErrorReason.INSTANCE_DRAINING, "decode is draining", {"requestId": request_id}
                )
            available = self.pool.num_free_blocks - self.num_reserved_blocks()
            refusal = capacity_refusal(request_id, size, available, self.capacity_retry_s)
            if refusal is None:
                refusal = share_refusal(
                    request_id,
                    size.num_blocks,
                    self.num_uncommitted_blocks(peer_key),
                    self.pool.num_blocks,
                    self.max_lease_share,
                    is_contended=self._asks.is_contended(peer_key, self.clock(), self.ttl_s),
                    retry_delay_s=self.capacity_retry_s,
                )
            if refusal is not None:
                self.num_refused += 1
                raise refusal
            lease = DecodeRequest(
                lease_id=uuid.uuid4().hex,
                request_id=request_id,
                block_ids=self.pool.allocate(size.num_blocks),
                num_kv_tokens=num_kv_tokens,
                max_new_tokens=max_new_tokens,
                expires_at=self.clock() + self.ttl_s,
                lease_token=lease_access.new_lease_token(),
                allocated_by=caller,
                peer_key=peer_key,
                num_computed_tokens=num_kv_tokens,
                num_remaining_tokens=max_new_tokens,
            )
            self._leases[lease.lease_id] = lease
            self.num_granted += 1
            return lease

    # ---- lookups and transitions -----------------------------------------------------------

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

    # ---- who may write or release (rules in `lease_access`) -------------------------------

    def begin_sync(
        self,
        lease_id: str,
        token: bytes,
        caller: Identity | None,
        *,
        is_token_only: bool = False,
    ) -> DecodeRequest:
        """Moves lease `lease_id` to SYNCING if `caller` may write into it with `token`;
        checked and moved under one lock, so a token opens one transfer at most. From here
        until `end_sync` the lease's blocks stay reserved even if it ends (a writer may still
        be filling them). `is_token_only`: a channel without caller identities (the TCP
        data port), where the token is the whole credential.

        Raises:
            PdserveError: LEASE_EXPIRED / LEASE_NOT_FOUND as `get`; PERMISSION_DENIED (the
                lease unchanged) when refused.
        """
        with self.lock:
            lease = self.get(lease_id)
            refusal = lease_access.sync_refusal(
                lease, token, caller, is_insecure=self.is_insecure or is_token_only
            )
            if refusal is not None:
                raise self._denied("SyncCache", lease, caller, refusal)
            lease.move_to(RequestStatus.SYNCING)
            lease.is_being_written = True
            return lease

    def end_sync(self, lease: DecodeRequest) -> None:
        """The transfer into `lease` stopped writing: frees its blocks if it ended meanwhile."""
        with self.lock:
            lease.is_being_written = False
            if self._held_for_writer.pop(lease.lease_id, None) is not None:
                self.pool.free(lease.block_ids)
                lease.block_ids = []

    def check_release(
        self, lease: DecodeRequest, request_id: str, token: bytes, caller: Identity | None
    ) -> None:
        """Raises PERMISSION_DENIED (the lease unchanged) unless `caller` may release `lease`."""
        refusal = lease_access.release_refusal(
            lease, request_id, token, caller, is_insecure=self.is_insecure
        )
        if refusal is not None:
            raise self._denied("ReleaseLease", lease, caller, refusal)

    def _denied(
        self, rpc: str, lease: DecodeRequest, caller: Identity | None, refusal: str
    ) -> PdserveError:
        with self.lock:
            self.num_access_refused += 1
            return lease_access.denied(rpc, lease, caller, refusal, self.num_access_refused)

    def extend(self, lease: DecodeRequest, num_tokens: int) -> bool:
        """Grows a RUNNING lease's block table to hold `num_tokens`; False if the pool is short."""
        with self.lock:
            missing = num_blocks_for(num_tokens, self.block_size) - len(lease.block_ids)
            if missing <= 0:
                return True
            if not self.pool.can_allocate(missing):
                return False
            lease.block_ids.extend(self.pool.allocate(missing))
            return True

    def end(self, request: DecodeRequest, status: RequestStatus) -> bool:
        """Ends `request` in terminal `status` (`DecodeRequest.end` frees its blocks, once) and
        forgets it, remembering how it ended.

        Returns:
            True if this call ended it; False if it had already ended.
        """
        with self.lock:
            is_held = request.is_being_written
            if not request.end(status, None if is_held else self.pool):
                return False
            if is_held:
                self._held_for_writer[request.lease_id] = request
            self._leases.pop(request.lease_id, None)
            self._ended[request.lease_id] = status
            while len(self._ended) > NUM_REMEMBERED_ENDED:
                self._ended.popitem(last=False)
            if status is RequestStatus.EXPIRED:
                self.num_expired += 1
            return True

    def due_for_expiry(self) -> list[DecodeRequest]:
        """Open leases past their deadline that were never committed and attached."""
        now = self.clock()
        with self.lock:
            return [
                lease
                for lease in self._leases.values()
                if lease.expires_at < now
                and (lease.status < RequestStatus.COMMITTED or not lease.is_attached)
            ]

    # ---- introspection ---------------------------------------------------------------------

    def open_leases(self) -> list[DecodeRequest]:
        with self.lock:
            return list(self._leases.values())

    def num_leased_blocks(self) -> int:
        """Blocks held by leases that are not running yet."""
        with self.lock:
            return sum(
                len(lease.block_ids)
                for lease in self._leases.values()
                if lease.status < RequestStatus.RUNNING
            )

    def check_integrity(self) -> None:
        """Raises AssertionError unless the pool is consistent and leases own disjoint blocks
        that are exactly the pool's used blocks."""
        with self.lock:
            self.pool.check_integrity()
            holders = [*self._leases.values(), *self._held_for_writer.values()]
            owned = [b for lease in holders for b in lease.block_ids]
            assert len(owned) == len(set(owned)), "a block is owned by two leases"
            assert len(owned) == self.pool.num_used_blocks, (
                f"leases own {len(owned)} blocks but the pool has {self.pool.num_used_blocks} used"
            )
