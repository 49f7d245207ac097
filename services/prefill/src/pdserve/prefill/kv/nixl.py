"""The NIXL KV channel: the lease's blocks written into the decode's registered cache with one-sided
WRITEs from this prefill's own cache (`pdserve.kv.transports.nixl`,
`pdserve.kv.transports.nixl_window`).

This prefill's agent starts on a thread when the instance starts (`NixlSide`); a transfer that
comes first waits for it. Writes, checksums and commit are those of every in-place channel
(`pdserve.prefill.kv.channels.InPlaceChannel`): the WRITEs of a group of pieces are posted at
once and announced once all of them completed. A decode agent that cannot be loaded, or a
local agent that did not start, raises `TransportUnavailable` before anything was written, so
the sender falls back to the next transport.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.engine.kv_cache import KVCache
from pdserve.kv.transfer import KvPiece
from pdserve.kv.transports.nixl import (
    AGENT_START_WAIT_S,
    CacheAgent,
    NixlPeers,
    NixlTarget,
    NixlUnavailable,
)
from pdserve.kv.transports.nixl import start_agent as start_nixl_agent
from pdserve.kv.transports.nixl_window import NixlWindow
from pdserve.prefill.kv.channels import InPlaceChannel, TransportUnavailable, ask_lease_state
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

    async def send(self, pieces: Sequence[KvPiece], *, corrupt_first: bool = False) -> None:
        try:
            await super().send(pieces, corrupt_first=corrupt_first)
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
