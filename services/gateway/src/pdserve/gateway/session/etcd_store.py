"""Resumable requests' records in the registry's etcd (``--registry etcd://...``): keys under
``<namespace>/pdserve/resume/``, each under an etcd lease whose TTL is the record's time to
live, so etcd deletes expired records by itself.

Each gateway keeps a key of its own alive under ``<namespace>/pdserve/resume-holders/`` (a
short lease, `EtcdLeasedKey`) while it runs, and stamps its id on every record it writes. A
running request whose record names a gateway whose key is gone (it died, or lost etcd for
longer than its TTL) is an orphan: another gateway adopts it (one etcd transaction decides
which) and runs it to its end, so a background response or a stream nobody follows finishes
when its gateway died. A gateway writes no running record before its own key is in etcd, so a
record never names a gateway that is merely starting.

A client that could not reach etcd is replaced: the next operation connects anew, instead of
waiting on a connection a network partition stalled (TCP resumes it only at its next, backed
off, retransmission: seconds to tens of seconds after the link is back). The replaced client
is closed once the calls it may still carry have timed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aetcd
import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.etcd_registration import EtcdLeasedKey
from pdserve.common.etcd_registry import RPC_TIMEOUT_S, EtcdTarget
from pdserve.gateway.session.store import RESUME_PREFIX, MemoryResumeStore, ResumeRecord

log = structlog.get_logger("pdserve.gateway.session.etcd_store")

HOLDERS_PREFIX = "/pdserve/resume-holders/"
# NOTE: `orphans` reads every record when a gateway's key went away since its last look (and
# on its first); also every this many looks, for a gateway that came and went between two.
FULL_SCAN_EVERY = 20


class EtcdResumeStore:
    """Records in the registry's etcd, under leases this gateway shares between its records.

    A record lives at least its TTL: it is put under a lease granted for that TTL plus an
    eighth of it, and a new lease is granted once an eighth of the TTL has passed since the
    last grant, so the records of a request cost one put each (no grant per record). A
    record after the first is put only if the stored one is still the one this gateway wrote
    last (an
    etcd transaction on the key's modification revision), so a cancel written through
    another gateway stays; so is a placement.

    Args:
        target: The registry's etcd (its namespace prefixes the keys).
        max_records: Most records this gateway creates while they live (etcd holds every
            gateway's; each gateway bounds what it adds): past it the ended record of this
            gateway's nearest its expiry is deleted (`MemoryResumeStore`).
        holder_ttl_s: TTL of this gateway's key (`hold`): how long after it stops answering
            another gateway may adopt its running requests.
        clock: Monotonic clock.
    """

    def __init__(
        self,
        target: EtcdTarget,
        max_records: int,
        holder_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._target = target
        self._prefix = target.namespace + RESUME_PREFIX
        self._holders_prefix = target.namespace + HOLDERS_PREFIX
        self.holder_id = uuid.uuid4().hex[:16]
        holder_id = self.holder_id
        self.holder = EtcdLeasedKey(
            target,
            (self._holders_prefix + holder_id).encode(),
            holder_id.encode,
            holder_ttl_s,
            holder_ttl_s / 3,
            {"holder_id": holder_id},
        )
        self._holding: asyncio.Task[None] | None = None
        # NOTE: the gateways whose keys `orphans` saw last (None: it has not looked yet).
        self._seen_holders: set[str] | None = None
        self._num_looks = 0
        self._client: aetcd.Client | None = None
        self._limit = MemoryResumeStore(max_records, clock)
        self._clock = clock
        # NOTE: TTL -> (lease, when it was granted): the lease records of that TTL go under.
        self._leases: dict[float, tuple[int, float]] = {}
        # NOTE: request id -> the key's modification revision of this gateway's last write.
        self._revisions: dict[str, int] = {}
        self._retiring: dict[aetcd.Client, asyncio.Task[None]] = {}
        self.num_writes = 0
        self.num_reconnects = 0

    def _key(self, request_id: str) -> bytes:
        return (self._prefix + request_id).encode()

    def _etcd(self) -> aetcd.Client:
        if self._client is None:
            self._client = self._target.client()
        return self._client

    def _unreachable(self, error: aetcd.ClientError) -> PdserveError:
        """The typed error for `error`; a client that could not reach etcd is replaced."""
        client = self._client
        if isinstance(error, aetcd.ConnectionFailedError | aetcd.ConnectionTimeoutError) and (
            client is not None
        ):
            self._client = None
            self.num_reconnects += 1
            self._retiring[client] = asyncio.create_task(self._retire(client))
        return _unreachable(error)

    async def _retire(self, client: aetcd.Client) -> None:
        # NOTE: closing now would cancel calls still on it; each ends within its timeout.
        await asyncio.sleep(RPC_TIMEOUT_S)
        self._retiring.pop(client, None)
        with contextlib.suppress(Exception):
            await client.close()

    async def _lease(self, ttl_s: float) -> int:
        """A lease that outlives `ttl_s` from now (granted again an eighth of it later)."""
        now = self._clock()
        held = self._leases.get(ttl_s)
        if held is not None and now - held[1] < ttl_s / 8:
            return held[0]
        lease = await self._etcd().lease(max(1, round(ttl_s * 9 / 8)))
        self._leases[ttl_s] = (lease.id, now)
        return int(lease.id)

    def hold(self) -> None:
        """Keeps this gateway's key alive until `close` (its running requests are not
        orphans while it lives)."""
        if self._holding is None:
            self._holding = asyncio.get_running_loop().create_task(self.holder.run())

    async def _held(self, record: ResumeRecord) -> ResumeRecord:
        """`record` stamped with this gateway's id, once its key is in etcd (a running
        record is never written before: it would look orphaned)."""
        if record.end is None and self._holding is not None:
            try:
                await asyncio.wait_for(self.holder.is_registered.wait(), RPC_TIMEOUT_S)
            except TimeoutError as error:
                raise _unreachable(error) from error
        return replace(record, holder=self.holder_id)

    async def put(self, record: ResumeRecord, ttl_s: float) -> None:
        # NOTE: the count of this gateway's live records is kept locally (an etcd count per
        # write would cost a range request each time).
        await self._count(record, ttl_s)
        record = await self._held(record)
        try:
            lease = await self._lease(ttl_s)
            put = await self._etcd().put(self._key(record.request_id), record.to_json(), lease)
        except aetcd.ClientError as error:
            raise self._unreachable(error) from error
        self._written(record, put.header.revision)

    async def _count(self, record: ResumeRecord, ttl_s: float) -> None:
        """Counts `record` among this gateway's; the ended records that made room for it are
        deleted from etcd too (each gateway bounds what it adds there).

        Raises:
            PdserveError: RATE_LIMITED as `MemoryResumeStore.put`, PEER_UNAVAILABLE.
        """
        dropped = self._limit.admit(replace(record, body=""), ttl_s)
        if dropped is None:
            return
        self._revisions.pop(dropped, None)
        try:
            await self._etcd().delete(self._key(dropped))
        except aetcd.ClientError as error:
            raise self._unreachable(error) from error

    def _written(self, record: ResumeRecord, revision: int) -> None:
        if record.end is None:
            self._revisions[record.request_id] = revision
        else:
            self._revisions.pop(record.request_id, None)
        self.num_writes += 1

    async def put_unless_ended(self, record: ResumeRecord, ttl_s: float) -> ResumeRecord | None:
        revision = self._revisions.get(record.request_id)
        if revision is None:
            stored = await self.get(record.request_id)
            if stored is not None and stored.end is not None:
                return stored
            await self.put(record, ttl_s)
            return None
        await self._count(record, ttl_s)
        record = await self._held(record)
        is_written, answers = await self._put_at(record, revision, ttl_s, read_on_failure=True)
        if is_written:
            return None
        self._revisions.pop(record.request_id, None)
        found = answers[0] if answers else None
        if not found:
            return None  # NOTE: deleted meanwhile: nothing to keep
        stored = ResumeRecord.from_json(found[0][0])
        if stored.end is not None:
            return stored
        await self.put(record, ttl_s)  # NOTE: taken over and placed elsewhere, not ended
        return None

    async def get(self, request_id: str) -> ResumeRecord | None:
        try:
            found = await self._etcd().get(self._key(request_id))
        except aetcd.ClientError as error:
            raise self._unreachable(error) from error
        return None if found is None else ResumeRecord.from_json(found.value)

    async def delete(self, request_id: str) -> None:
        await self._limit.delete(request_id)
        self._revisions.pop(request_id, None)
        try:
            await self._etcd().delete(self._key(request_id))
        except aetcd.ClientError as error:
            raise self._unreachable(error) from error

    async def orphans(self) -> list[tuple[ResumeRecord, int]]:
        try:
            found = await self._etcd().get_prefix(self._holders_prefix.encode(), keys_only=True)
            holders = {kv.key.decode().rpartition("/")[2] for kv in found}
            self._num_looks += 1
            seen, self._seen_holders = self._seen_holders, holders
            is_due = self._num_looks % FULL_SCAN_EVERY == 0
            if seen is not None and not (seen - holders) and not is_due:
                return []
            records = await self._etcd().get_prefix(self._prefix.encode())
        except aetcd.ClientError as error:
            self._seen_holders = None  # NOTE: look at every record again next time
            raise self._unreachable(error) from error
        orphans = []
        for kv in records:
            record = ResumeRecord.from_json(kv.value)
            holder = record.holder
            if record.end is None and holder is not None and holder not in holders:
                orphans.append((record, int(kv.mod_revision)))
        return orphans

    async def adopt(self, record: ResumeRecord, revision: int, ttl_s: float) -> bool:
        adopted = await self._held(record)
        is_written, _ = await self._put_at(adopted, revision, ttl_s, read_on_failure=False)
        if is_written:
            await self._count(adopted, ttl_s)
        return is_written

    async def _put_at(
        self, record: ResumeRecord, revision: int, ttl_s: float, read_on_failure: bool
    ) -> tuple[bool, Any]:
        """Puts `record` if its key is still at `revision` (one etcd transaction); where it is
        not, the same transaction reads the stored record when `read_on_failure`.

        Returns:
            Whether it was written, and the transaction's answers.
        """
        etcd = self._etcd()
        key = self._key(record.request_id)
        try:
            lease = await self._lease(ttl_s)
            is_written, answers = await etcd.transaction(
                compare=[etcd.transactions.mod(key) == revision],
                success=[etcd.transactions.put(key, record.to_json(), lease)],
                failure=[etcd.transactions.get(key)] if read_on_failure else [],
            )
        except aetcd.ClientError as error:
            raise self._unreachable(error) from error
        if is_written:
            self._written(record, answers[0].response_put.header.revision)
        return bool(is_written), answers

    async def close(self) -> None:
        if self._holding is not None:
            # NOTE: the key goes at once: the other gateways adopt what this one left.
            await self.holder.stop()
            await asyncio.gather(self._holding, return_exceptions=True)
            self._holding = None
        retiring, self._retiring = self._retiring, {}
        for client, task in retiring.items():
            task.cancel()
            with contextlib.suppress(Exception):
                await client.close()
        if self._client is not None:
            await self._client.close()
            self._client = None


def _unreachable(error: Exception) -> PdserveError:
    # NOTE: the client's library words go to the log; the error says what is unreachable.
    log.warning("resume_store_unreachable", error=type(error).__name__, detail=str(error))
    return PdserveError(
        ErrorReason.PEER_UNAVAILABLE,
        "the store of resumable requests (etcd) cannot be reached; retry shortly",
        retry_delay_s=1.0,
    )
