"""The NIXL KV channel: the lease's blocks written into the decode's registered cache with one-sided
WRITEs from this prefill's own cache (`pdserve.kv.transports.nixl`,
`pdserve.kv.transports.nixl_window`).

This prefill's agent starts on a thread when the instance starts (`NixlSide`); a transfer that
comes first waits for it. Writes, checksums and commit are those of every in-place channel
(`pdserve.prefill.kv.channels.InPlaceChannel`), pipelined: a batch of pieces is cut into
groups of a few MiB; one worker thread posts each group's WRITEs as one transfer and waits for
them, group after group without a pause, while another checksums the groups from this cache
(both release the GIL; between two processes of one host the post itself copies, through CMA),
and each group is announced once its WRITEs completed and its checksums are known (a chunk per
run of a layer's blocks in it), while the later groups are written. A decode agent that cannot
be loaded, or a local agent that did not start, raises `TransportUnavailable` before anything
was written, so the sender falls back to the next transport.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.engine.kv_cache import KVCache
from pdserve.kv.transfer import KvPiece, chunk_runs, run_crc32c
from pdserve.kv.transports.nixl import (
    AGENT_START_WAIT_S,
    CacheAgent,
    NixlPeers,
    NixlTarget,
    NixlUnavailable,
)
from pdserve.kv.transports.nixl import start_agent as start_nixl_agent
from pdserve.kv.transports.nixl_window import NixlWindow
from pdserve.prefill import convert
from pdserve.prefill.kv.channels import (
    GROUP_BYTES,
    InPlaceChannel,
    TransportUnavailable,
    ask_lease_state,
    piece_groups,
)
from pdserve.prefill.request import Request
from pdserve.v1 import decode_pb2_grpc

log = structlog.get_logger(__name__)


class NixlSide:
    """This prefill's NIXL agent (its cache registered as the WRITEs' source), started on a
    thread, and the decode agents it loaded.

    Args:
        kv_cache: The prefill's KV cache.
    """

    def __init__(self, kv_cache: KVCache) -> None:
        self._started: Future[CacheAgent] = start_nixl_agent(kv_cache, "prefill")
        self._started.add_done_callback(self._log_start)
        self._peers: NixlPeers | None = None

    async def peers(self) -> NixlPeers:
        """The agent and its peers, once the agent started.

        Raises:
            NixlUnavailable: The agent did not start.
        """
        if self._peers is None:
            self._peers = NixlPeers(await asyncio.wrap_future(self._started))
        return self._peers

    def close(self) -> None:
        """Deregisters the cache, once the agent started: an agent still starting is waited
        for (up to `AGENT_START_WAIT_S`), since a process that exits while NIXL builds one on
        its thread aborts."""
        futures.wait([self._started], timeout=AGENT_START_WAIT_S)
        if self._started.done() and self._started.exception() is None:
            self._started.result().close()

    @staticmethod
    def _log_start(started: Future[CacheAgent]) -> None:
        error = started.exception()
        if error is not None:
            log.info("kv_transport_unavailable", transport="nixl", detail=str(error))
        else:
            log.info(
                "kv_transport_ready",
                transport="nixl",
                agent=started.result().name,
                detail="used with decodes that offer it, in --kv-transports order",
            )


class NixlChannel(InPlaceChannel):
    """SyncCache whose chunks are written into the decode's cache with NIXL WRITEs.

    Args:
        stub: The decode's stub.
        request: The request (holding its lease; its blocks hold the KV in this prefill's
            cache).
        side: This prefill's agent.
        target: The lease's nixl offer (the decode's agent and the leased blocks).
    """

    name = "nixl"
    # Most K+V bytes written and checksummed before they are announced.
    group_bytes = GROUP_BYTES

    def __init__(
        self,
        stub: decode_pb2_grpc.DecodeServiceStub,
        request: Request,
        side: NixlSide,
        target: NixlTarget,
    ) -> None:
        super().__init__(stub, request)
        self.side = side
        self.target = target
        self._peers: NixlPeers | None = None
        self._window: NixlWindow | None = None

    async def open(self) -> None:
        try:
            self._peers = await self.side.peers()
        except NixlUnavailable as error:
            raise TransportUnavailable(str(error)) from None
        await super().open()

    async def send(self, pieces: Sequence[KvPiece], *, corrupt_first: bool = False) -> int:
        try:
            return await self._send_pipelined(pieces, corrupt_first)
        except NixlUnavailable as error:
            # NOTE: a WRITE failed (the decode's process or connection is gone); the lease
            # says whether the decode ended the transfer first.
            log.info(
                "nixl_write_failed", decode_address=self.request.decode_address, detail=str(error)
            )
            local = PdserveError(
                ErrorReason.PEER_UNAVAILABLE,
                f"a NIXL WRITE of the KV to decode {self.request.decode_address} failed",
                {
                    "requestId": self.request.request_id,
                    "decodeAddress": self.request.decode_address,
                },
            )
            raise await ask_lease_state(self.stub, self.request, local) from None

    async def _send_pipelined(self, pieces: Sequence[KvPiece], corrupt_first: bool) -> int:
        """Writes the groups one after another on one worker thread and checksums them on
        another, and announces each group once both are done with it, while later groups are
        written (the module docstring); returns once every group is announced, with the number
        of chunks announced. Both threads are always waited for, also when this fails or is
        cancelled (as `InPlaceChannel.send`: no WRITE is left under way); they stop after their
        group."""
        groups = piece_groups(pieces, self.group_bytes)
        loop = asyncio.get_running_loop()
        landed: list[asyncio.Future[None]] = [loop.create_future() for _ in groups]
        checked: list[asyncio.Future[list[tuple[list[KvPiece], int]]]] = [
            loop.create_future() for _ in groups
        ]
        num_chunks = 0
        stop = threading.Event()
        workers = asyncio.gather(
            asyncio.to_thread(self._land_all, groups, corrupt_first, landed, stop),
            asyncio.to_thread(_check_all, groups, checked, stop),
        )
        try:
            for is_landed, runs in zip(landed, checked, strict=True):
                await is_landed
                num_chunks += await self._announce(await runs)
            return num_chunks
        finally:
            stop.set()
            try:
                await asyncio.shield(workers)
            except asyncio.CancelledError:
                await workers
                raise
            finally:
                futures_: list[asyncio.Future[Any]] = [*landed, *checked]
                for future in futures_:
                    if future.done() and not future.cancelled():
                        future.exception()  # NOTE: retrieved; raised above where it mattered

    def _land_all(
        self,
        groups: Sequence[Sequence[KvPiece]],
        corrupt_first: bool,
        landed: Sequence[asyncio.Future[None]],
        stop: threading.Event,
    ) -> None:
        """Posts each group's WRITEs and waits for them, in order, until one fails or `stop`
        is set; resolves the group's future once they are in the decode's cache."""
        for group, future in zip(groups, landed, strict=True):
            if stop.is_set():
                return
            try:
                assert self._window is not None
                for i, piece in enumerate(group):
                    self._window.take(piece, corrupt=corrupt_first and i == 0)
                corrupt_first = False
                self._window.wait()
            except Exception as error:  # NOTE: raised where the group is awaited
                _settle(future, error=error)
                return
            _settle(future, None)

    async def _announce(self, checked: Sequence[tuple[list[KvPiece], int]]) -> int:
        for run, crc in checked:
            await self._write(convert.kv_chunk_meta(run, crc))
        return len(checked)

    def _open_writer(self) -> NixlWindow:
        lease = self.request.lease
        assert lease is not None and self._peers is not None
        try:
            self._window = NixlWindow(self._peers, self.target, lease.num_shared_blocks)
        except NixlUnavailable as error:
            raise TransportUnavailable(str(error)) from None
        return self._window

    def _wait_landed(self) -> None:
        assert self._window is not None
        self._window.wait()


def _check_all(
    groups: Sequence[Sequence[KvPiece]],
    checked: Sequence[asyncio.Future[list[tuple[list[KvPiece], int]]]],
    stop: threading.Event,
) -> None:
    """Resolves each group's future with its runs (`chunk_runs`, one chunk each) and their
    CRC-32C (read from this prefill's cache), in order, until `stop` is set."""
    for group, future in zip(groups, checked, strict=True):
        if stop.is_set():
            return
        try:
            _settle(future, [(run, run_crc32c(run)) for run in chunk_runs(group)])
        except Exception as error:  # NOTE: raised where the group is awaited
            _settle(future, error=error)
            return


def _settle(
    future: asyncio.Future[Any], result: Any = None, error: BaseException | None = None
) -> None:
    """Resolves `future` from a worker thread (on its loop; nothing if it is already done)."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    future.get_loop().call_soon_threadsafe(settle)
