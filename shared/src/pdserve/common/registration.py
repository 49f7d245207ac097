"""Keeps a prefill or decode instance registered with a gateway's RegistryService.

`RegistrationClient.run()` registers, then heartbeats with a fresh load report at the interval
the gateway asks for. When the gateway answers INSTANCE_NOT_REGISTERED (it restarted or dropped
the instance) the client registers again; a heartbeat that fails otherwise is sent again at
once, then with capped backoff while the gateway stays unreachable. `stop()` ends the loop,
waiting for a call under way (a Register the gateway may already have counted), then
deregisters (best effort).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from pdserve.common.errors import ErrorReason, PdserveError, from_rpc_error
from pdserve.common.logging import get_logger
from pdserve.common.pki import role_dns_name
from pdserve.common.security import Security
from pdserve.v1 import common_pb2, registry_pb2, registry_pb2_grpc

log = get_logger(__name__)

DEFAULT_INTERVAL_S = 1.0
MAX_BACKOFF_S = 5.0
RPC_TIMEOUT_S = 5.0


class RegistrationClient:
    """Registers `instance` with the gateway at `gateway_address` and heartbeats its load.

    Args:
        gateway_address: "host:port" of the gateway's gRPC server.
        instance: What to register (identity, address, protocol, KV layout).
        load_report: Called before every register/heartbeat for the current load.
        security: How to reach the gateway's internal port (mTLS: the gateway must present a
            gateway certificate of the cluster CA); plaintext when None.
    """

    def __init__(
        self,
        gateway_address: str,
        instance: common_pb2.InstanceInfo,
        load_report: Callable[[], common_pb2.LoadReport],
        security: Security | None = None,
    ) -> None:
        self.gateway_address = gateway_address
        self.instance = instance
        self.load_report = load_report
        self.interval_s = DEFAULT_INTERVAL_S
        self.num_registrations = 0
        self.is_registered = asyncio.Event()
        self._stopping = asyncio.Event()
        self._run_ended = asyncio.Event()
        self._run_ended.set()  # no run() under way
        self._channel = (security or Security.insecure()).channel(
            gateway_address, role_dns_name("gateway")
        )
        self._stub = registry_pb2_grpc.RegistryServiceStub(self._channel)

    async def run(self) -> None:
        """Registers and heartbeats until `stop()`; never raises for gateway trouble."""
        self._run_ended.clear()
        try:
            await self._keep_registered()
        finally:
            self._run_ended.set()

    async def _keep_registered(self) -> None:
        backoff_s = self.interval_s
        num_failed = 0
        while not self._stopping.is_set():
            call = "heartbeat" if self.is_registered.is_set() else "register"
            try:
                if call == "register":
                    await self._register()
                else:
                    await self._heartbeat()
                backoff_s, num_failed = self.interval_s, 0
                await self._sleep(self.interval_s)
            except PdserveError as error:
                if error.reason is ErrorReason.INSTANCE_NOT_REGISTERED:
                    log.info("registration_lost", instance_id=self.instance.instance_id)
                    self.is_registered.clear()
                    continue
                num_failed += 1
                log.warning(
                    "registration_failed",
                    gateway=self.gateway_address,
                    call=call,
                    num_failed=num_failed,
                    reason=error.reason.name,
                    detail=error.message,
                )
                # NOTE: a failed heartbeat most likely met a stall (this process or the
                # gateway paused a moment): it is sent again at once, the instance still
                # registered (the gateway answers INSTANCE_NOT_REGISTERED if it dropped it
                # meanwhile). Registering again only after a backoff left the gateway without
                # news for seconds more, past its TTL on a busy host.
                if call == "heartbeat" and num_failed == 1:
                    continue
                self.is_registered.clear()
                await self._sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)

    async def stop(self) -> None:
        """Ends `run()` and deregisters (best effort)."""
        self._stopping.set()
        # NOTE: a Register under way may have reached the gateway: wait for its answer (every
        # call is bounded by RPC_TIMEOUT_S), so that it is deregistered, not left to expire.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._run_ended.wait(), RPC_TIMEOUT_S + 1)
        if self.is_registered.is_set():
            try:
                await self._stub.Deregister(
                    registry_pb2.DeregisterRequest(instance_id=self.instance.instance_id),
                    timeout=RPC_TIMEOUT_S,
                )
                log.info("deregistered", instance_id=self.instance.instance_id)
            except grpc.RpcError as error:
                log.warning("deregister_failed", reason=from_rpc_error(error).reason.name)
        self.is_registered.clear()
        await self._channel.close()

    async def _register(self) -> None:
        request = registry_pb2.RegisterRequest(instance=self.instance, load=self.load_report())
        response = await self._call(self._stub.Register, request)
        self.num_registrations += 1
        self.is_registered.set()
        log.info(
            "registered",
            gateway=self.gateway_address,
            instance_id=self.instance.instance_id,
            heartbeat_interval_ms=response.heartbeat_interval_ms,
        )

    async def _heartbeat(self) -> None:
        request = registry_pb2.HeartbeatRequest(
            instance_id=self.instance.instance_id, load=self.load_report()
        )
        await self._call(self._stub.Heartbeat, request)

    async def _call(self, rpc: Callable[..., Awaitable[Any]], request: Any) -> Any:
        """Register or Heartbeat: a failed call raises its `PdserveError`; the interval the
        gateway asks for is adopted."""
        try:
            response = await rpc(request, timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        if response.heartbeat_interval_ms:
            self.interval_s = response.heartbeat_interval_ms / 1000
        return response

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)
