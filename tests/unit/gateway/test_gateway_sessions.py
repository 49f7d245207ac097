"""The session layer on its own: which deltas a client at a position still needs (one rule for
REST ``starting_after`` and gRPC ``from_index``), that a kept request exists only for its
owner's key, and that cancelling one that runs on another gateway ends it in the store and
releases its decode lease."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason
from pdserve.gateway.access.api_keys import ApiKey
from pdserve.gateway.access.auth import Caller
from pdserve.gateway.fleet.backend import Backend, BackendError
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import ApiKind, OutputDelta, Placement, ResponseStatus, Usage
from pdserve.gateway.session import sessions as sessions_module
from pdserve.gateway.session.access import Lookup
from pdserve.gateway.session.positions import is_after
from pdserve.gateway.session.runs import Runs
from pdserve.gateway.session.session import Parsed, Session, SessionMode
from pdserve.gateway.session.sessions import Sessions
from pdserve.gateway.session.store import MemoryResumeStore, ResumeRecord, StoredEnd
from pdserve.gateway.streaming import Streamer

USAGE = Usage(num_prompt_tokens=4, num_completion_tokens=3)
START = OutputDelta("", (), 0)  # NOTE: before the first token (a role, the prompt's logprobs)
TOKENS = [OutputDelta(text, (10 + i,), i) for i, text in enumerate(("a", "b", "c"))]
HELD = OutputDelta("", (), 3)  # NOTE: text released after the last token (no token of its own)
FINAL = OutputDelta("!", (), 3, FinishReason.STOP, USAGE)
STREAM = [START, *TOKENS, HELD, FINAL]


@pytest.mark.parametrize(
    ("delta", "after", "needed"),
    [
        (START, None, True),  # from the start: everything
        (TOKENS[0], None, True),
        (START, 0, False),  # a client at 0 has the events before the first token
        (TOKENS[0], 0, True),
        (TOKENS[1], 1, True),  # the token after the client's last
        (TOKENS[1], 2, False),  # a token it has
        (TOKENS[2], 2, True),
        (HELD, 2, True),  # a step after its last token
        (HELD, 3, True),  # at its last token: the step may have come after the client left
        (HELD, 4, False),  # past the end
        (FINAL, 3, True),  # the end
        (FINAL, 9, True),  # past the end: the end
        (OutputDelta("", (), 0, FinishReason.LENGTH, USAGE), 0, True),  # an empty completion
    ],
)
def test_which_deltas_a_client_at_a_position_needs(
    delta: OutputDelta, after: int | None, needed: bool
) -> None:
    assert is_after(delta, after) is needed


def _session(deltas: list[OutputDelta], error: PdserveError | None = None) -> Session:
    async def source() -> AsyncGenerator[tuple[int, OutputDelta], None]:
        for delta in deltas:
            yield 0, delta
        if error is not None:
            raise error

    return Session(ApiKind.CHAT, [cast(PreparedRequest, None)], source)


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        (None, STREAM),
        (0, STREAM[1:]),
        (2, [TOKENS[2], HELD, FINAL]),
        (3, [HELD, FINAL]),
        (7, [FINAL]),
    ],
)
async def test_a_session_gives_the_deltas_after_a_position(
    after: int | None, expected: list[OutputDelta]
) -> None:
    got = [delta async for _, delta in _session(STREAM).deltas(after)]
    assert got == expected
    steps = [step async for step in _session(STREAM).steps(after)]
    assert [step.delta for step in steps] == STREAM  # NOTE: a stateful writer sees them all
    assert [step.delta for step in steps if step.is_after] == expected
    assert [step.position for step in steps] == [0, 1, 2, 3, 3, 3]


async def test_a_failed_session_past_its_end_gives_only_its_error() -> None:
    failed = PdserveError(ErrorReason.CANCELLED, "the response was cancelled")
    got: list[OutputDelta] = []
    with pytest.raises(PdserveError) as raised:
        async for _, delta in _session(TOKENS, failed).deltas(5):
            got.append(delta)
    assert got == [] and raised.value is failed


# ---- kept requests in the store --------------------------------------------------------------

ALICE = Caller(ApiKey("alice", b"a"), "key:alice")
BOB = Caller(ApiKey("bob", b"b"), "key:bob")
PLACEMENT = Placement("decode-1", "127.0.0.1:9", "lease-7")
RECORD = ResumeRecord("r1", ApiKind.RESPONSES, "alice", "{}", 42, 1700000000.0, PLACEMENT)
KINDS = (ApiKind.RESPONSES,)


class _Backend:
    """Records the leases released; fails them when told to."""

    def __init__(self, fails: bool = False) -> None:
        self.released: list[tuple[str, str, str]] = []
        self.fails = fails

    async def release_lease(
        self, address: str, lease_id: str, request_id: str, timeout_s: float, *_: Any
    ) -> None:
        self.released.append((address, lease_id, request_id))
        if self.fails:
            raise BackendError(
                PdserveError(ErrorReason.PEER_UNAVAILABLE, "gone"), is_from_server=False
            )


def _sessions(store: MemoryResumeStore, backend: _Backend) -> Sessions:
    streamer = cast(Streamer, None)  # NOTE: nothing runs here: every request is in the store
    runs = Runs(store, streamer, GatewayMetrics(), request_timeout_s=60, keep_s=60)
    return Sessions(streamer, cast(Frontend, None), runs, cast(Backend, backend))


async def _never_parsed(raw: bytes) -> Parsed:
    raise AssertionError("a request its caller may not see is not parsed")


@pytest.mark.parametrize(
    ("caller", "kinds"),
    [(BOB, KINDS), (ALICE, (ApiKind.CHAT,)), (Caller(None, "anonymous"), KINDS)],
)
async def test_another_keys_request_is_not_found(caller: Caller, kinds: tuple[ApiKind]) -> None:
    store = MemoryResumeStore(10)
    await store.put(RECORD, ttl_s=60)
    sessions = _sessions(store, _Backend())
    for look in (sessions.resume, sessions.snapshot):
        with pytest.raises(PdserveError) as missing:
            await look(Lookup("r1", kinds, caller, "resp_r1"), _never_parsed)
        assert missing.value.reason is ErrorReason.REQUEST_NOT_FOUND
        assert "resp_r1" in missing.value.message
    with pytest.raises(PdserveError):
        await sessions.cancel(Lookup("r1", kinds, caller))
    with pytest.raises(PdserveError):
        await sessions.delete(Lookup("r1", kinds, caller))
    assert await store.get("r1") == RECORD  # NOTE: untouched


@pytest.mark.parametrize("fails", [False, True])
async def test_cancelling_a_request_running_elsewhere_releases_its_lease(fails: bool) -> None:
    store = MemoryResumeStore(10)
    await store.put(RECORD, ttl_s=60)
    backend = _Backend(fails)
    await _sessions(store, backend).cancel(Lookup("r1", KINDS, ALICE))
    assert backend.released == [("127.0.0.1:9", "lease-7", "r1")]
    stored = await store.get("r1")
    assert stored is not None and stored.end is not None
    assert stored.end.status is ResponseStatus.CANCELLED  # NOTE: also when the release failed


async def test_an_ended_request_stays_as_it_ended_and_is_deleted_by_its_owner() -> None:
    store = MemoryResumeStore(10)
    ended = ResumeRecord(**{**RECORD.__dict__, "end": StoredEnd(ResponseStatus.COMPLETED, (5,))})
    await store.put(ended, ttl_s=60)
    backend = _Backend()
    sessions = _sessions(store, backend)
    await sessions.cancel(Lookup("r1", KINDS, ALICE))
    assert backend.released == [] and await store.get("r1") == ended
    await sessions.delete(Lookup("r1", KINDS, ALICE))
    assert await store.get("r1") is None


class _OrphanStore(MemoryResumeStore):
    """A store whose running records all belong to a gone gateway; adopting one succeeds
    only for the ids in `winnable` (another gateway is first to the others)."""

    def __init__(self, winnable: set[str]) -> None:
        super().__init__(10)
        self.winnable = winnable
        self.tried: list[str] = []

    async def orphans(self) -> list[tuple[ResumeRecord, int]]:
        records = [await self.get(request_id) for request_id in list(self._records)]
        return [(r, 1) for r in records if r is not None and r.end is None]

    async def adopt(self, record: ResumeRecord, revision: int, ttl_s: float) -> bool:
        self.tried.append(record.request_id)
        return record.request_id in self.winnable


async def _unparsable(raw: bytes) -> Parsed:
    raise PdserveError(ErrorReason.MODEL_NOT_FOUND, "no instance serves the model 'm'")


async def test_an_orphan_is_adopted_once_and_one_that_cannot_run_ends_failed() -> None:
    """Of a gone gateway's running requests: one another gateway adopted first is left alone
    (never parsed), one of an API no front end here registered is not tried, and one adopted
    here that can no longer be prepared ends failed in the store, with why."""
    store = _OrphanStore(winnable={"mine"})
    for request_id, kind in (("theirs", KINDS[0]), ("mine", KINDS[0]), ("g", ApiKind.GRPC)):
        record = ResumeRecord(**{**RECORD.__dict__, "request_id": request_id, "kind": kind})
        await store.put(record, 60)
    sessions = _sessions(store, _Backend())
    sessions.parse_stored_with(ApiKind.RESPONSES, _unparsable)
    assert await sessions.adopt_orphans() == 0
    assert sorted(store.tried) == ["mine", "theirs"]  # NOTE: no gRPC front end here
    theirs, mine = await store.get("theirs"), await store.get("mine")
    assert theirs is not None and theirs.end is None
    assert mine is not None and mine.end is not None
    assert mine.end.status is ResponseStatus.FAILED
    assert mine.end.error_code == "model_not_found" and "'m'" in str(mine.end.error_message)


# ---- stored requests: plain, their end written to the store ---------------------------------


class _Streamer:
    """Streams `STREAM` (then `error`, if any) for any request."""

    def __init__(self, error: PdserveError | None = None) -> None:
        self.error = error

    async def stream(
        self, prepared: object, index: int = 0
    ) -> AsyncGenerator[tuple[int, OutputDelta], None]:
        for delta in STREAM if self.error is None else TOKENS:
            yield index, delta
        if self.error is not None:
            raise self.error


class _SlowStore(MemoryResumeStore):
    """Writes once `may_write` is set."""

    def __init__(self) -> None:
        super().__init__(10)
        self.may_write = asyncio.Event()

    async def put(self, record: ResumeRecord, ttl_s: float) -> None:
        await self.may_write.wait()
        await super().put(record, ttl_s)


def _stored(store: MemoryResumeStore, error: PdserveError | None = None) -> tuple[Sessions, Runs]:
    streamer = cast(Streamer, _Streamer(error))
    runs = Runs(store, streamer, GatewayMetrics(), request_timeout_s=60, keep_s=60)
    return Sessions(streamer, cast(Frontend, None), runs), runs


PROMPT = cast(
    PreparedRequest,
    SimpleNamespace(request_id="r9", request=SimpleNamespace(sampling=SimpleNamespace(seed=5))),
)


async def test_a_stored_request_is_in_the_store_before_its_client_has_its_end() -> None:
    store = MemoryResumeStore(10)
    sessions, _ = _stored(store)
    session = await sessions.open(KINDS[0], [PROMPT], ALICE, SessionMode.STORED, b"{}")
    async for _, delta in session.deltas():
        stored = await store.get("r9")
        assert (stored is not None) is (delta is FINAL)
    assert stored is not None and stored.end is not None
    assert (stored.owner, stored.seed, stored.body) == ("alice", 5, "{}")
    assert (stored.end.status, stored.end.token_ids) == (ResponseStatus.COMPLETED, (10, 11, 12))
    assert session.record == stored and session.clock() == stored.end.completed_at


async def test_a_stored_request_that_failed_is_stored_failed() -> None:
    store = MemoryResumeStore(10)
    sessions, _ = _stored(store, PdserveError(ErrorReason.INTERNAL, "broke"))
    session = await sessions.open(KINDS[0], [PROMPT], ALICE, SessionMode.STORED, b"{}")
    with pytest.raises(PdserveError, match="broke"):
        [delta async for delta in session.deltas()]
    stored = await store.get("r9")
    assert stored is not None and stored.end is not None
    assert (stored.end.status, stored.end.error_code) == (ResponseStatus.FAILED, "internal")


async def test_a_slow_store_does_not_hold_the_answer_and_writes_it_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sessions_module, "STORED_END_WAIT_S", 0.01)
    store = _SlowStore()
    sessions, runs = _stored(store)
    session = await sessions.open(KINDS[0], [PROMPT], ALICE, SessionMode.STORED, b"{}")
    assert [delta async for _, delta in session.deltas()] == STREAM
    assert await MemoryResumeStore.get(store, "r9") is None
    store.may_write.set()
    await runs.leave(hand_over=False)  # NOTE: a gateway that stops waits for the write
    stored = await store.get("r9")
    assert stored is not None and stored.end is not None
