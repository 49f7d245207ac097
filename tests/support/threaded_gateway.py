"""A gateway with one fake prefill and decode on an event loop of its own thread.

For synchronous clients (hypothesis properties, blocking HTTP connections, a probe process):
the test talks to the gateway over its ports while the gateway runs undisturbed. The fakes
heartbeat like real instances, so the cluster stays up for as long as a test module needs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from support.gateway_cluster import Cluster
from support.gateway_fakes import heartbeat

T = TypeVar("T")
HEARTBEAT_INTERVAL_S = 1.0


class ThreadedCluster:
    """Starts a `Cluster` (gateway + prefill + decode) on a background event loop.

    Args:
        gateway_settings: `GatewayConfig` overrides.
    """

    def __init__(self, **gateway_settings: Any) -> None:
        self.cluster = Cluster()
        self._settings = gateway_settings
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._heartbeats: asyncio.Task[None] | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Runs `coro` on the gateway's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def start(self) -> ThreadedCluster:
        self._thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        await self.cluster.start_gateway(**self._settings)
        await self.cluster.add_prefill()
        await self.cluster.add_decode()
        self._heartbeats = asyncio.create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        # NOTE: on the internal port: the public one serves no RegistryService, and a failed
        # heartbeat would end this task and let the instances expire mid-module.
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            for instance in [*self.cluster.prefills, *self.cluster.decodes]:
                await heartbeat(self.cluster.internal_address, instance)

    async def _stop(self) -> None:
        if self._heartbeats is not None:
            if self._heartbeats.done():
                self._heartbeats.result()  # raises what ended the heartbeats early
            self._heartbeats.cancel()
            await asyncio.gather(self._heartbeats, return_exceptions=True)
        await self.cluster.close()

    def stop(self) -> None:
        try:
            self.run(self._stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    @property
    def loop_thread_id(self) -> int:
        """The identifier of the thread the gateway's event loop runs on."""
        assert self._thread.ident is not None
        return self._thread.ident

    @property
    def http_port(self) -> int:
        assert self.cluster.gateway is not None and self.cluster.gateway.http_port is not None
        return self.cluster.gateway.http_port

    @property
    def grpc_address(self) -> str:
        return self.cluster.grpc_address
