"""Who gets a lease and who may write into it or release it, over the lease table.

`LeaseManager` holds the `LeaseTable` (its ``table``: the open leases, their transitions and
the one lock, in `lease_table`) and applies its rules: admission with headroom for
AllocateBlocks (the arithmetic of headroom, capacity and per-peer share is pure, in
`lease_admission`), the prompt blocks a completion shares with a live lease of the same prompt
(pure, in `block_sharing`), and the access checks of SyncCache and ReleaseLease (the rules are
pure, in `lease_access`), each under the table's lock. On a cache whose sliding layers keep
only their window, a lease also takes the window slots of its last blocks (`sliding_kv`) and
shares no blocks (another lease's blocks may have let their sliding KV go).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.pki import Identity
from pdserve.decode import lease_access
from pdserve.decode.block_sharing import NO_SHARE, pending_source, share_grant, share_source
from pdserve.decode.lease_admission import (
    LeaseSize,
    RecentAsks,
    capacity_refusal,
    lease_size,
    length_refusal,
    num_owed_blocks,
    share_refusal,
)
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.lease_table import LeaseTable
from pdserve.decode.request import DecodeRequest
from pdserve.decode.sliding_kv import SlidingKV
from pdserve.engine.block_pool import BlockPool


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
        sliding: The window slots of a cache whose sliding layers keep only their window.
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
        sliding: SlidingKV | None = None,
    ) -> None:
        self.table = LeaseTable(pool, block_size, clock, sliding)
        """The open leases, their transitions and the lock every transition runs under."""
        self.reserve_tokens = reserve_tokens
        self.ttl_s = ttl_s
        self.capacity_retry_s = capacity_retry_s
        self._asks = RecentAsks()
        self.max_model_len = max_model_len
        self.max_lease_share = max_lease_share
        self.is_insecure = is_insecure
        self.is_draining = False
        self.num_granted = 0
        self.num_refused = 0
        self.num_access_refused = 0
        self.num_shared_leases = 0
        self.num_shared_blocks = 0

    # ---- admission -------------------------------------------------------------------------

    def num_reserved_blocks(self) -> int:
        """Free blocks owed to open leases as growth headroom."""
        with self.table.lock:
            return num_owed_blocks(
                self.table.open_leases(),
                reserve_tokens=self.reserve_tokens,
                block_size=self.table.block_size,
            )

    def num_uncommitted_blocks(self, peer_key: str) -> int:
        """Blocks that `peer_key`'s leases hold before their commit (ALLOCATED, SYNCING)."""
        with self.table.lock:
            return sum(
                len(lease.block_ids) - lease.num_shared_blocks
                for lease in self.table.open_leases()
                if lease.peer_key == peer_key and lease.status < RequestStatus.COMMITTED
            )

    def pending_share_source(self, share_key: str) -> DecodeRequest | None:
        """An open lease of `share_key` whose KV has not been committed yet (whose `ready`
        a sibling's allocation may wait for, to share its blocks), unless one is committed
        (or blocks are not shared here: window slots)."""
        with self.table.lock:
            if self.table.sliding is not None:
                return None
            if share_source(self.table.open_leases(), share_key) is not None:
                return None
            return pending_source(self.table.open_leases(), share_key)

    def allocate(
        self,
        request_id: str,
        num_kv_tokens: int,
        max_new_tokens: int,
        *,
        caller: Identity | None = None,
        prefill_instance_id: str = "",
        share_key: str = "",
    ) -> DecodeRequest:
        """Grants a lease (with a fresh token) for `num_kv_tokens` of KV, keeping headroom for
        running requests and within the share of the pool the calling peer may hold
        uncommitted (`caller`: its certified identity; `prefill_instance_id`: the id it states).
        With a `share_key` that an open, committed lease holds, the new lease references that
        lease's full prompt blocks instead of new ones (`block_sharing`; its
        ``num_shared_blocks``), and only the rest counts against the pool.

        Raises:
            PdserveError: INSTANCE_DRAINING; INVALID_REQUEST; PROMPT_TOO_LONG past
                ``max_model_len``; DECODE_CAPACITY_EXHAUSTED (with a retry delay) when free
                blocks minus owed headroom do not cover the prompt and its own headroom, or
                when a peer already holding uncommitted leases would exceed its share.
        """
        refusal = length_refusal(request_id, num_kv_tokens, max_new_tokens, self.max_model_len)
        if refusal is not None:
            raise refusal
        size = lease_size(num_kv_tokens, max_new_tokens, self.reserve_tokens, self.table.block_size)
        peer_key = lease_access.peer_key(caller, prefill_instance_id)
        with self.table.lock:
            if self.is_draining:
                raise PdserveError(
                    ErrorReason.INSTANCE_DRAINING, "decode is draining", {"requestId": request_id}
                )
            sliding = self.table.sliding
            share = (
                share_grant(
                    share_source(self.table.open_leases(), share_key),
                    num_kv_tokens,
                    self.table.block_size,
                )
                if sliding is None
                else NO_SHARE
            )
            size = LeaseSize(size.num_blocks - len(share.block_ids), size.num_headroom_blocks)
            available = self.table.pool.num_free_blocks - self.num_reserved_blocks()
            refusal = capacity_refusal(request_id, size, available, self.capacity_retry_s)
            if refusal is None and sliding is not None:
                refusal = sliding.refusal(
                    request_id,
                    num_kv_tokens,
                    size.num_blocks,
                    len(self.table.open_leases()),
                    self.capacity_retry_s,
                )
            if refusal is None:
                refusal = share_refusal(
                    request_id,
                    size.num_blocks,
                    self.num_uncommitted_blocks(peer_key),
                    self.table.pool.num_blocks,
                    self.max_lease_share,
                    is_contended=self._asks.is_contended(peer_key, self.table.clock(), self.ttl_s),
                    retry_delay_s=self.capacity_retry_s,
                )
            if refusal is not None:
                self.num_refused += 1
                raise refusal
            self.table.pool.touch(share.block_ids)
            lease = DecodeRequest(
                lease_id=uuid.uuid4().hex,
                request_id=request_id,
                block_ids=[*share.block_ids, *self.table.pool.allocate(size.num_blocks)],
                num_kv_tokens=num_kv_tokens,
                max_new_tokens=max_new_tokens,
                expires_at=self.table.clock() + self.ttl_s,
                lease_token=lease_access.new_lease_token(),
                allocated_by=caller,
                peer_key=peer_key,
                num_computed_tokens=num_kv_tokens,
                num_remaining_tokens=max_new_tokens,
                share_key=share_key,
                num_shared_blocks=len(share.block_ids),
                shared_token_ids=share.token_ids,
            )
            if sliding is not None:
                sliding.grant(lease)
            self.table.add(lease)
            self.num_granted += 1
            if share.block_ids:
                self.num_shared_leases += 1
                self.num_shared_blocks += len(share.block_ids)
            return lease

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
        with self.table.lock:
            lease = self.table.get(lease_id)
            refusal = lease_access.sync_refusal(
                lease, token, caller, is_insecure=self.is_insecure or is_token_only
            )
            if refusal is not None:
                raise self._denied("SyncCache", lease, caller, refusal)
            lease.move_to(RequestStatus.SYNCING)
            lease.is_being_written = True
            return lease

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
        with self.table.lock:
            self.num_access_refused += 1
            return lease_access.denied(rpc, lease, caller, refusal, self.num_access_refused)
