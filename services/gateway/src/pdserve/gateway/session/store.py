"""Where a resumable request's record lives, so that every gateway can read it.

A record is written a bounded number of times per request, never per token: when the request
is accepted, each time a decode takes it (a placement: once, plus once per reschedule), and when
it ends. What it holds is what another gateway needs to take the request over or to answer for
it: the request as the client sent it (re-prepared on that gateway, with the seed it was given,
gives the same prompt and the same tokens), its owner key, where it runs, which gateway runs
it, and once it ended its completion tokens and how it ended.

Two stores: `MemoryResumeStore` (one gateway: resumes across client reconnects to it) and
`pdserve.gateway.session.etcd_store.EtcdResumeStore` (``--registry etcd://...``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.request import ApiKind, Placement, ResponseStatus

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

    status: ResponseStatus
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
        kind: The API that took it.
        owner: Name of the API key that created it; None on an open gateway (anyone).
        body: The request as the client sent it (JSON text).
        seed: The seed it runs with.
        created_at: Wall-clock start.
        placement: Where it runs now; None before a decode took it.
        end: How it ended; None while it runs.
        holder: The gateway that wrote it last (the store stamps it): while it runs, the one
            running it. None in a store only one gateway reads, and in older records.
    """

    request_id: str
    kind: ApiKind
    owner: str | None
    body: str
    seed: int
    created_at: float
    placement: Placement | None = None
    end: StoredEnd | None = None
    holder: str | None = None

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
            **{**raw, "kind": ApiKind(raw["kind"])},
            placement=None if placement is None else Placement(**placement),
            end=None if end is None else _stored_end(end),
        )

    def with_placement(self, placement: Placement) -> ResumeRecord:
        """A copy placed on `placement`."""
        return replace(self, placement=placement)


def _stored_end(end: dict[str, Any]) -> StoredEnd:
    status = ResponseStatus(end["status"])
    return StoredEnd(**{**end, "status": status, "token_ids": tuple(end["token_ids"])})


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
            PdserveError: RATE_LIMITED when the store holds its most records, all of them
                running (a new record; an ended one makes room), PEER_UNAVAILABLE when the
                store cannot be reached.
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

    async def orphans(self) -> list[tuple[ResumeRecord, int]]:
        """Records of running requests whose gateway is gone (none in a store only one gateway
        reads), each with the revision `adopt` compares against.

        Raises:
            PdserveError: PEER_UNAVAILABLE when the store cannot be reached.
        """
        ...

    async def adopt(self, record: ResumeRecord, revision: int, ttl_s: float) -> bool:
        """Makes this gateway the holder of an orphan, unless it changed since `orphans` read
        it (another gateway adopted it first, or it ended).

        Raises:
            PdserveError: PEER_UNAVAILABLE when the store cannot be reached.
        """
        ...

    async def close(self) -> None:
        """Lets go of connections."""
        ...


def _full(max_records: int) -> PdserveError:
    return PdserveError(
        ErrorReason.RATE_LIMITED,
        f"the gateway keeps at most {max_records} resumable requests and stored responses "
        "(--max-stored-responses), all of them running; retry once some have ended",
        {"limit": "max_stored_responses"},
    )


@dataclass
class MemoryResumeStore:
    """Records in this gateway's memory, each until its time to live runs out.

    Args:
        max_records: Most records held (running and ended). A new one past it takes the place
            of the ended record nearest its expiry; when every record is of a running request,
            it is refused.
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

    def _make_room(self) -> str:
        """Drops the ended record nearest its expiry and says which (none ended: full)."""
        ended = [(expires, k) for k, (r, expires) in self._records.items() if r.end is not None]
        if not ended:
            raise _full(self.max_records)
        _, request_id = min(ended)
        del self._records[request_id]
        return request_id

    def admit(self, record: ResumeRecord, ttl_s: float) -> str | None:
        """`put`, saying which ended record made room for it (None: none had to).

        Raises:
            PdserveError: RATE_LIMITED as `put`.
        """
        self._expire()
        is_new = record.request_id not in self._records
        dropped = self._make_room() if is_new and len(self._records) >= self.max_records else None
        self._records[record.request_id] = (record, self.clock() + ttl_s)
        self.num_writes += 1
        return dropped

    async def put(self, record: ResumeRecord, ttl_s: float) -> None:
        self.admit(record, ttl_s)

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

    async def orphans(self) -> list[tuple[ResumeRecord, int]]:
        return []  # NOTE: this gateway's records die with it

    async def adopt(self, record: ResumeRecord, revision: int, ttl_s: float) -> bool:
        return False

    async def close(self) -> None:
        return None
