"""Where a resumable request's record lives, so that every gateway can read it.

A record is written a bounded number of times per request, never per token: when the request
is accepted, each time a decode takes it (a placement: once, plus once per reschedule), and when
it ends. What it holds is what another gateway needs to take the request over or to answer for
it: the request as the client sent it (re-prepared on that gateway, with the seed it was given,
gives the same prompt and the same tokens), its owner key, where it runs, and once it ended its
completion tokens and how it ended.

Two stores: `MemoryResumeStore` (one gateway: resumes across client reconnects to it) and
`EtcdResumeStore` (``--registry etcd://...``: the registry's etcd, keys under
``<namespace>/pdserve/resume/``, each under an etcd lease whose TTL is the record's time to
live, so etcd deletes expired records by itself).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import aetcd

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.etcd_registry import EtcdTarget
from pdserve.gateway.request import Placement

RESUME_PREFIX = "/pdserve/resume/"


@dataclass(frozen=True)
class StoredEnd:
    """How a request ended.

    Attributes:
        status: ``completed``, ``incomplete``, ``failed`` or ``cancelled``.
        token_ids: Every completion token (empty for a request that failed before any).
        finish_reason: The finish reason's value (None when it failed or was cancelled).
        num_cached_prompt_tokens: Prompt tokens whose KV was reused.
        completed_at: Wall-clock end.
        error_code: The error's reason in lower case (failed or cancelled only).
        error_message: Its message.
    """

    status: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    num_cached_prompt_tokens: int = 0
    completed_at: float = 0.0
    error_code: str | None = None
    error_message: str | None = None


@dataclass(frozen=True)
class ResumeRecord:
    """What any gateway knows about a resumable request.

    Attributes:
        request_id: The gateway's request id (a response's id is ``resp_<request_id>``).
        kind: ``responses``, ``chat``, ``completions`` or ``grpc``: the API that took it.
        owner: Name of the API key that created it; None on an open gateway (anyone).
        body: The request as the client sent it (JSON text).
        seed: The seed it runs with.
        created_at: Wall-clock start.
        placement: Where it runs now; None before a decode took it.
        end: How it ended; None while it runs.
    """

    request_id: str
    kind: str
    owner: str | None
    body: str
    seed: int
    created_at: float
    placement: Placement | None = None
    end: StoredEnd | None = None

    def to_json(self) -> bytes:
        """The record as compact JSON."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ResumeRecord:
        """Reads `to_json`'s output."""
        raw: dict[str, Any] = json.loads(data)
        placement = raw.pop("placement")
        end = raw.pop("end")
        return cls(
            **raw,
            placement=None if placement is None else Placement(**placement),
            end=None if end is None else StoredEnd(**{**end, "token_ids": tuple(end["token_ids"])}),
        )

    def with_placement(self, placement: Placement) -> ResumeRecord:
        """A copy placed on `placement`."""
        return replace(self, placement=placement)


class ResumeStore(Protocol):
    """Records of resumable requests, shared by the gateways that can read them."""

    @property
    def num_writes(self) -> int:
        """Records written since start (for the cost of resumability per request)."""
        ...

    async def put(self, record: ResumeRecord, ttl_s: float) -> None:
        """Writes `record`; it is deleted at least `ttl_s` later (at most an eighth of that
        more) unless written again.

        Raises:
            PdserveError: RATE_LIMITED when the store holds its most records (a new record),
                PEER_UNAVAILABLE when the store cannot be reached.
        """
        ...

    async def put_unless_ended(self, record: ResumeRecord, ttl_s: float) -> ResumeRecord | None:
        """Writes `record` (a placement or an end) unless the stored one ended already
        (cancelled through another gateway).

        Returns:
            None when it was written; else the stored record, which stays.

        Raises:
            PdserveError: PEER_UNAVAILABLE when the store cannot be reached.
        """
        ...

    async def get(self, request_id: str) -> ResumeRecord | None:
        """The record of `request_id`, or None (unknown or expired).

        Raises:
            PdserveError: PEER_UNAVAILABLE when the store cannot be reached.
        """
        ...

    async def delete(self, request_id: str) -> None:
        """Forgets `request_id` (idempotent)."""
        ...

    async def close(self) -> None:
        """Lets go of connections."""
        ...


def _full(max_records: int) -> PdserveError:
    return PdserveError(
        ErrorReason.RATE_LIMITED,
        f"the gateway keeps at most {max_records} resumable requests (--max-stored-responses);"
        " retry once some have expired",
        {"limit": "max_stored_responses"},
    )


@dataclass
class MemoryResumeStore:
    """Records in this gateway's memory, each until its time to live runs out.

    Args:
        max_records: Most records held (running and kept); a new one past it is refused.
        clock: Monotonic clock.
    """

    max_records: int
    clock: Callable[[], float] = time.monotonic
    num_writes: int = 0
    _records: dict[str, tuple[ResumeRecord, float]] = field(default_factory=dict)

    def _expire(self) -> None:
        now = self.clock()
        for request_id in [k for k, (_, expires) in self._records.items() if expires <= now]:
            del self._records[request_id]

    async def put(self, record: ResumeRecord, ttl_s: float) -> None:
        self._expire()
        is_new = record.request_id not in self._records
        if is_new and len(self._records) >= self.max_records:
            raise _full(self.max_records)
        self._records[record.request_id] = (record, self.clock() + ttl_s)
        self.num_writes += 1

    async def put_unless_ended(self, record: ResumeRecord, ttl_s: float) -> ResumeRecord | None:
        stored = await self.get(record.request_id)
        if stored is not None and stored.end is not None:
            return stored
        await self.put(record, ttl_s)
        return None

    async def get(self, request_id: str) -> ResumeRecord | None:
        self._expire()
        held = self._records.get(request_id)
        return None if held is None else held[0]

    async def delete(self, request_id: str) -> None:
        self._records.pop(request_id, None)

    async def close(self) -> None:
        return None


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
            gateway's; each gateway bounds what it adds).
        clock: Monotonic clock.
    """

    def __init__(
        self, target: EtcdTarget, max_records: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._target = target
        self._prefix = target.namespace + RESUME_PREFIX
        self._client: aetcd.Client | None = None
        self._limit = MemoryResumeStore(max_records, clock)
        self._clock = clock
        # NOTE: TTL -> (lease, when it was granted): the lease records of that TTL go under.
        self._leases: dict[float, tuple[int, float]] = {}
        # NOTE: request id -> the key's modification revision of this gateway's last write.
        self._revisions: dict[str, int] = {}
        self.num_writes = 0

    def _key(self, request_id: str) -> bytes:
        return (self._prefix + request_id).encode()

    def _etcd(self) -> aetcd.Client:
        if self._client is None:
            self._client = self._target.client()
        return self._client

    async def _lease(self, ttl_s: float) -> int:
        """A lease that outlives `ttl_s` from now (granted again an eighth of it later)."""
        now = self._clock()
        held = self._leases.get(ttl_s)
        if held is not None and now - held[1] < ttl_s / 8:
            return held[0]
        lease = await self._etcd().lease(max(1, round(ttl_s * 9 / 8)))
        self._leases[ttl_s] = (lease.id, now)
        return int(lease.id)

    async def put(self, record: ResumeRecord, ttl_s: float) -> None:
        # NOTE: the count of this gateway's live records is kept locally (an etcd count per
        # write would cost a range request each time).
        await self._limit.put(replace(record, body=""), ttl_s)
        try:
            lease = await self._lease(ttl_s)
            put = await self._etcd().put(self._key(record.request_id), record.to_json(), lease)
        except aetcd.ClientError as error:
            raise _unreachable(error) from error
        self._written(record, put.header.revision)

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
        await self._limit.put(replace(record, body=""), ttl_s)
        etcd = self._etcd()
        key = self._key(record.request_id)
        try:
            lease = await self._lease(ttl_s)
            is_written, answers = await etcd.transaction(
                compare=[etcd.transactions.mod(key) == revision],
                success=[etcd.transactions.put(key, record.to_json(), lease)],
                failure=[etcd.transactions.get(key)],
            )
        except aetcd.ClientError as error:
            raise _unreachable(error) from error
        if is_written:
            self._written(record, answers[0].response_put.header.revision)
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
            raise _unreachable(error) from error
        return None if found is None else ResumeRecord.from_json(found.value)

    async def delete(self, request_id: str) -> None:
        await self._limit.delete(request_id)
        self._revisions.pop(request_id, None)
        try:
            await self._etcd().delete(self._key(request_id))
        except aetcd.ClientError as error:
            raise _unreachable(error) from error

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


def _unreachable(error: Exception) -> PdserveError:
    return PdserveError(
        ErrorReason.PEER_UNAVAILABLE,
        f"the store of resumable requests cannot be reached: {type(error).__name__}",
    )
