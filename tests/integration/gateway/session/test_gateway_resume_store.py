"""The store of resumable requests: records round-trip as JSON, expire after their time to
live, are bounded in number; in etcd (a real one) they are shared, etcd deletes them when
their lease lapses, and a running request whose gateway's key is gone is an orphan exactly one
other gateway adopts. (Which deltas a resuming client still needs: test_gateway_sessions.)"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from support.etcd_server import EtcdServer, running_etcd
from support.eventually import eventually

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.etcd_registry import EtcdTarget
from pdserve.gateway.request import Placement
from pdserve.gateway.session.etcd_store import EtcdResumeStore
from pdserve.gateway.session.store import MemoryResumeStore, ResumeRecord, StoredEnd

# NOTE: how soon after a cut link is back the store must reach etcd again.
RECONNECT_S = 4.0

RECORD = ResumeRecord(
    request_id="r1",
    kind="responses",
    owner="alice",
    body='{"model": "m", "input": "hi"}',
    seed=42,
    created_at=1700000000.5,
)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_record_round_trips_as_json() -> None:
    placed = RECORD.with_placement(Placement("decode-1", "127.0.0.1:5", "lease-9"))
    ended = StoredEnd("completed", (5, 6, 7), "length", 3, 1700000001.0)
    held = replace(placed, holder="g1")
    for record in (RECORD, placed, ResumeRecord(**{**RECORD.__dict__, "end": ended}), held):
        assert ResumeRecord.from_json(record.to_json()) == record
    # NOTE: a record an older gateway wrote (no holder) reads as held by nobody.
    older = RECORD.to_json().replace(b',"holder":null', b"")
    assert b"holder" not in older and ResumeRecord.from_json(older) == RECORD


async def test_the_memory_store_expires_records_and_bounds_their_number() -> None:
    clock = _Clock()
    store = MemoryResumeStore(max_records=2, clock=clock)
    await store.put(RECORD, ttl_s=10)
    await store.put(RECORD, ttl_s=10)  # NOTE: a rewrite is not a new record
    await store.put(ResumeRecord(**{**RECORD.__dict__, "request_id": "r2"}), ttl_s=5)
    with pytest.raises(PdserveError) as refused:
        await store.put(ResumeRecord(**{**RECORD.__dict__, "request_id": "r3"}), ttl_s=5)
    assert refused.value.reason is ErrorReason.RATE_LIMITED
    assert refused.value.metadata["limit"] == "max_stored_responses"
    clock.now = 6
    assert await store.get("r2") is None
    assert await store.get("r1") == RECORD
    await store.put(ResumeRecord(**{**RECORD.__dict__, "request_id": "r3"}), ttl_s=5)
    clock.now = 11
    assert await store.get("r1") is None
    assert store.num_writes == 4


def _record(request_id: str, is_ended: bool = False) -> ResumeRecord:
    end = StoredEnd("completed", (5,), "stop", 0, 1700000001.0) if is_ended else None
    return replace(RECORD, request_id=request_id, end=end)


async def test_a_full_memory_store_drops_the_ended_record_nearest_its_expiry() -> None:
    store = MemoryResumeStore(max_records=3, clock=_Clock())
    assert store.admit(_record("running"), ttl_s=100) is None
    await store.put(_record("later", is_ended=True), ttl_s=20)
    await store.put(_record("sooner", is_ended=True), ttl_s=10)
    assert store.admit(_record("new"), ttl_s=100) == "sooner"
    assert await store.get("sooner") is None
    assert await store.get("later") is not None and await store.get("running") is not None
    assert store.admit(_record("newer"), ttl_s=100) == "later"
    with pytest.raises(PdserveError) as refused:  # NOTE: all three run: nothing may go
        await store.put(_record("newest"), ttl_s=100)
    assert refused.value.reason is ErrorReason.RATE_LIMITED
    # NOTE: its end is not a new record: nothing is dropped for it.
    assert store.admit(_record("new", is_ended=True), ttl_s=100) is None
    assert store.admit(_record("newest"), ttl_s=100) == "new"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with running_etcd(tmp_path) as server:
        yield server


async def test_etcd_stores_share_records_and_etcd_expires_them(etcd: EtcdServer) -> None:
    target = EtcdTarget.parse(f"{etcd.spec}/ns")
    writer, reader = EtcdResumeStore(target, 8), EtcdResumeStore(target, 8)
    try:
        await writer.put(RECORD, ttl_s=2)
        assert await reader.get("r1") == replace(RECORD, holder=writer.holder_id)
        assert await reader.get("unknown") is None

        async def expired() -> bool:
            return await reader.get("r1") is None

        await eventually(expired, 30, "etcd deleted the record when its lease lapsed")
        await writer.put(RECORD, ttl_s=30)
        await reader.delete("r1")
        assert await writer.get("r1") is None
    finally:
        await writer.close()
        await reader.close()


async def test_an_etcd_store_deletes_what_it_dropped_to_make_room(etcd: EtcdServer) -> None:
    target = EtcdTarget.parse(f"{etcd.spec}/ns")
    writer, reader = EtcdResumeStore(target, 2), EtcdResumeStore(target, 2)
    try:
        await writer.put(_record("ended", is_ended=True), ttl_s=60)
        await writer.put(_record("running"), ttl_s=60)
        await writer.put(_record("new"), ttl_s=60)
        assert await reader.get("ended") is None
        assert await reader.get("running") is not None and await reader.get("new") is not None
    finally:
        await writer.close()
        await reader.close()


async def test_a_cancel_written_through_another_gateway_stays(etcd: EtcdServer) -> None:
    target = EtcdTarget.parse(etcd.spec)
    holder, other = EtcdResumeStore(target, 8), EtcdResumeStore(target, 8)
    finished = StoredEnd("completed", (1, 2), "stop", 0, 2.0)
    cancelled = StoredEnd("cancelled", (), None, 0, 1.0, "cancelled", "the response was cancelled")
    try:
        # NOTE: the holder's placement and end land, each one transaction on the revision of
        # its last write (a stale revision would cost a read and a second put).
        await holder.put(RECORD, ttl_s=30)
        placed_first = RECORD.with_placement(Placement("d", "a", "l"))
        assert await holder.put_unless_ended(placed_first, ttl_s=30) is None
        written = await holder._etcd().get(holder._key("r1"))
        assert written is not None
        assert holder._revisions["r1"] == written.mod_revision
        ended = ResumeRecord(**{**placed_first.__dict__, "end": finished})
        assert await holder.put_unless_ended(ended, ttl_s=30) is None
        assert await other.get("r1") == replace(ended, holder=holder.holder_id)

        # NOTE: a cancel through another gateway comes first: the holder's end does not land.
        second = ResumeRecord(**{**RECORD.__dict__, "request_id": "r2"})
        await holder.put(second, ttl_s=30)
        with_cancel = ResumeRecord(**{**second.__dict__, "end": cancelled})
        assert await other.put_unless_ended(with_cancel, ttl_s=30) is None
        late = ResumeRecord(**{**second.__dict__, "end": finished})
        stored_cancel = replace(with_cancel, holder=other.holder_id)
        assert await holder.put_unless_ended(late, ttl_s=30) == stored_cancel
        # NOTE: nor does a placement the holder's retry wrote after it (it would reopen it).
        placed = second.with_placement(Placement("d", "a", "l2"))
        assert await holder.put_unless_ended(placed, ttl_s=30) == stored_cancel
        assert await other.get("r2") == stored_cancel
    finally:
        await holder.close()
        await other.close()


async def test_a_gone_gateways_running_requests_are_adopted_once(etcd: EtcdServer) -> None:
    """Gateway A holds its key and writes two running requests and an ended one; B and C see
    no orphan while A lives. A goes (its key with it): B and C both find A's running ones,
    and each is adopted by exactly one of them (the transaction on the record's revision),
    the winner's id stamped on it; the ended one is no orphan."""
    target = EtcdTarget.parse(f"{etcd.spec}/adopt")
    gone, b, c = (EtcdResumeStore(target, 8, holder_ttl_s=2) for _ in range(3))
    finished = StoredEnd("completed", (1, 2), "stop", 0, 2.0)
    try:
        for store in (gone, b, c):
            store.hold()
        await gone.put(RECORD, ttl_s=30)
        placed = replace(RECORD, request_id="r2").with_placement(Placement("d", "a", "l"))
        await gone.put(placed, ttl_s=30)
        await gone.put(replace(RECORD, request_id="r3", end=finished), ttl_s=30)
        assert await b.orphans() == [] and await c.orphans() == []
        await gone.close()  # NOTE: its key is revoked, as at a lapsed lease
        found_b, found_c = await b.orphans(), await c.orphans()
        assert sorted(r.request_id for r, _ in found_b) == ["r1", "r2"]
        assert sorted(r.request_id for r, _ in found_c) == ["r1", "r2"]
        assert all(r.holder == gone.holder_id for r, _ in found_b)
        won_b = [
            await b.adopt(r, rev, ttl_s=30)
            for r, rev in sorted(found_b, key=lambda f: f[0].request_id)
        ]
        won_c = [
            await c.adopt(r, rev, ttl_s=30)
            for r, rev in sorted(found_c, key=lambda f: f[0].request_id)
        ]
        assert won_b == [True, True] and won_c == [False, False]
        assert await c.get("r2") == replace(placed, holder=b.holder_id)
        # NOTE: B lives: its adopted requests are nobody's orphans now.
        assert await c.orphans() == []
    finally:
        for store in (gone, b, c):
            await store.close()


async def test_no_running_record_is_written_before_the_gateways_key(etcd: EtcdServer) -> None:
    """A record names a gateway only once that gateway's key is in etcd: the first put waits
    for it (else a starting gateway's requests would look orphaned)."""
    target = EtcdTarget.parse(f"{etcd.spec}/first")
    store, other = EtcdResumeStore(target, 8, holder_ttl_s=2), EtcdResumeStore(target, 8)
    try:
        store.hold()
        await store.put(RECORD, ttl_s=30)
        assert store.holder.is_registered.is_set()
        assert await other.orphans() == []
    finally:
        await store.close()
        await other.close()


async def test_an_unreachable_etcd_is_a_typed_error(etcd: EtcdServer) -> None:
    store = EtcdResumeStore(EtcdTarget.parse(etcd.spec), 8)
    etcd.stop()
    try:
        with pytest.raises(PdserveError) as failed:
            await store.get("r1")
        assert failed.value.reason is ErrorReason.PEER_UNAVAILABLE
    finally:
        await store.close()
        etcd.start()


class _CutLink:
    """A TCP relay in front of etcd that cuts the link as a partition does: the connections it
    carries go silent (`stall`; TCP resumes such a connection only at its next, backed-off
    retransmission: modelled as never) or break, and a connection opened while it is cut is
    never answered, not even once the link is back (its handshake was lost: TCP sends it again
    only seconds later). A connection opened once the link is back is relayed."""

    def __init__(self, host: str, port: int) -> None:
        self._to = (host, port)
        self.is_cut = False
        self._silenced: set[asyncio.StreamWriter] = set()
        self._carried: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> _CutLink:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._carried:
            writer.transport.abort()

    def cut(self, stall: bool) -> None:
        self.is_cut = True
        for writer in self._carried:
            if stall:
                self._silenced.add(writer)
            else:
                writer.transport.abort()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._carried.append(writer)
        if self.is_cut:
            return  # NOTE: held open and never answered
        up_reader, up_writer = await asyncio.open_connection(*self._to)
        self._carried.append(up_writer)

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(65536):
                    if writer in self._silenced:
                        continue  # NOTE: lost on the way
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


@pytest.mark.parametrize("stall", [True, False], ids=["stalled", "broken"])
async def test_the_store_reaches_etcd_again_soon_after_a_cut_link_is_back(
    etcd: EtcdServer, stall: bool
) -> None:
    """Neither a connection the cut stalled nor one the client opened while etcd was cut off
    may hold the store after the link is back."""
    async with _CutLink(etcd.host, etcd.port) as link:
        store = EtcdResumeStore(EtcdTarget.parse(f"etcd://127.0.0.1:{link.port}"), 8)
        try:
            await store.put(RECORD, ttl_s=30)
            link.cut(stall)
            with pytest.raises(PdserveError):
                await store.get("r1")
            link.is_cut = False
            back = time.monotonic()

            async def reached() -> bool:
                with contextlib.suppress(PdserveError):
                    return await store.get("r1") == replace(RECORD, holder=store.holder_id)
                return False

            await eventually(reached, RECONNECT_S, "the store reached etcd again")
            assert time.monotonic() - back < RECONNECT_S
        finally:
            await store.close()
