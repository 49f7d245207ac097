"""The server every prefill and decode runs: one scaffold with the role's parts plugged in.

`InstanceServer` holds what both roles share: the model, the gRPC server (the role's service,
InstanceService, health and reflection), the ``/metrics`` endpoint, registration and heartbeats
with ``--gateway``, and drain on SIGTERM. A role subclasses it: `build()` makes its engine
thread, request table and servicers once the port is bound and the instance is named, and it
answers the other hooks marked below. Each role's ``server.py`` adds `create_server(config)`
(build and start) and `serve(config)` (run until SIGTERM).
"""

from __future__ import annotations

import abc
import asyncio
import signal
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, ClassVar
from wsgiref.simple_server import WSGIServer

import grpc
import structlog
from grpc_health.v1 import health

from pdserve.common.authz import AuthorizationInterceptor
from pdserve.common.etcd_registration import EtcdRegistrationClient
from pdserve.common.grpc_server import (
    add_standard_services,
    new_aio_server,
    start_health_server,
)
from pdserve.common.memory import return_freed_memory
from pdserve.common.metrics import InstanceMetrics
from pdserve.common.registration import RegistrationClient
from pdserve.common.security import Security
from pdserve.common.supervisor import watch_supervisor
from pdserve.engine.thread import EngineThread
from pdserve.serving.config import InstanceConfig
from pdserve.serving.kv_tier import kv_store_counters, open_kv_tier
from pdserve.serving.model_host import ModelHost
from pdserve.serving.presence import (
    instance_info,
    registration_client,
    role_name,
    serve_metrics,
)
from pdserve.serving.status import InstanceStatus
from pdserve.v1 import common_pb2, instance_pb2, instance_pb2_grpc

log = structlog.get_logger(__name__)

INSTANCE_SERVICE = instance_pb2.DESCRIPTOR.services_by_name["InstanceService"].full_name
DRAIN_POLL_S = 0.05
# NOTE: how long an instance whose tensor-parallel rank is lost waits for its engine thread's
# step to end before it goes down without it (the thread is a daemon).
LOST_RANK_ENGINE_WAIT_S = 2.0


class InstanceServer(abc.ABC):
    """A prefill or decode server: the shared scaffold, with a role's parts plugged in.

    Constructing one loads the model (unless `host` is given), creates the gRPC server, binds
    the port, names the instance and calls `build()`; `start()` serves; `drain_and_stop()` and
    `stop()` end it. A subclass sets `role` and `service_name`, makes `loop`, `status` and
    `metrics` (and its own parts) in `build()` and implements the other hooks.

    Args:
        config: The instance's settings.
        host: An already loaded model to reuse (tests and benchmarks share one), or None.
        interceptors: gRPC server interceptors (tests inject faults with them).
        security: The internal plane's credentials; read from the config's TLS flags (or
            ``--insecure``) when None. With mTLS the instance id is the certificate's, and
            every call is checked against `pdserve.common.authz.CALLERS`.

    Attributes:
        server: The gRPC server.
        port: The bound port (useful with port 0).
        instance: The InstanceInfo this server registers and reports.
        health: The health servicer, once started.
        registration: Keeps the instance registered with ``--gateway`` or in ``--registry``;
            None without either.
        metrics_server: The ``/metrics`` endpoint with ``--metrics-port``; None without it.
        health_server: The plaintext health-only gRPC server with ``--health-port``; None
            without it.
        health_port: Its bound port; None without it.
        kv_store: The KV storage tier with ``--kv-store`` (None without one, or when it
            could not be opened at start: then every store operation is skipped).
        kv_writer: The worker thread that writes to `kv_store`; None without a store.
    """

    role: ClassVar[common_pb2.InstanceRole]
    service_name: ClassVar[str]
    loop: EngineThread
    status: InstanceStatus
    metrics: InstanceMetrics

    def __init__(
        self,
        config: InstanceConfig,
        host: ModelHost | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        security: Security | None = None,
    ) -> None:
        self.config = config
        self.security = security or Security.from_config(config, role_name(self.role))
        instance_id = self.security.instance_id(config.instance_id)
        self.host = host or ModelHost.from_config(config)
        self._owns_host = host is None
        guard = [] if self.security.is_insecure else [AuthorizationInterceptor()]
        self.server = new_aio_server([*guard, *interceptors])
        self.port = self.security.bind(self.server, f"{config.host}:{config.port}")
        self.instance = instance_info(config, self.role, self.port, self.host, instance_id)
        self.health: health.aio.HealthServicer | None = None
        self.registration: RegistrationClient | EtcdRegistrationClient | None = None
        self.metrics_server: WSGIServer | None = None
        self.health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.is_down = asyncio.Event()
        """Set once a lost tensor-parallel rank has taken the instance down."""
        self.kv_store, self.kv_writer = open_kv_tier(config, self.host.kv_layout.fingerprint)
        self.build()

    @property
    def address(self) -> str:
        """host:port peers use to reach this instance."""
        return self.instance.address

    # ---- what a role plugs in --------------------------------------------------------------

    @abc.abstractmethod
    def build(self) -> None:
        """Makes the role's parts (`loop`, `status`, `metrics`, servicers) from `config`,
        `host` and `instance`; called once by the constructor."""

    @abc.abstractmethod
    def add_service(self, server: grpc.aio.Server) -> None:
        """Registers the role's own gRPC service (the one named `service_name`) on `server`."""

    @abc.abstractmethod
    def counters(self) -> Mapping[str, tuple[str, float]]:
        """Running totals for ``/metrics``: ``{name: (help, value)}``, read at scrape time."""

    def all_counters(self) -> Mapping[str, tuple[str, float]]:
        """The role's `counters` and the KV store's (``kv_store_*``, with ``--kv-store``)."""
        return {**self.counters(), **kv_store_counters(self.kv_store, self.host.runner.block_size)}

    @abc.abstractmethod
    def stop_admitting(self) -> None:
        """Refuses new requests from now on (INSTANCE_DRAINING); load reports say draining."""

    @abc.abstractmethod
    def num_in_flight(self) -> int:
        """Requests a drain waits for."""

    @abc.abstractmethod
    def background(self) -> list[Coroutine[Any, Any, None]]:
        """Coroutines run as tasks while serving; `stop` cancels them."""

    @abc.abstractmethod
    async def at_drain_deadline(self) -> None:
        """Deals with requests still in flight when the drain time is up, before `stop`."""

    @abc.abstractmethod
    async def abort_in_flight(self) -> None:
        """In `stop`, before the server stops: aborts what is in flight."""

    @abc.abstractmethod
    async def close(self) -> None:
        """In `stop`, after the server stopped: closes the role's own clients."""

    # ---- the scaffold ----------------------------------------------------------------------

    def describe(self) -> dict[str, object]:
        """Log fields that name this instance (for the role's ``*_started`` event)."""
        return {
            "address": self.address,
            "instance_id": self.instance.instance_id,
            "num_blocks": self.host.num_blocks,
            "block_size": self.host.runner.block_size,
            "model": self.host.served_model_name,
            "internal_plane": self.security.describe(),
        }

    async def start(self) -> None:
        """Serves: metrics, the role's service with InstanceService, health and reflection,
        the engine thread, background tasks, then registration with the gateway."""
        self.status.is_insecure = self.security.is_insecure
        self.status.attention_backend = self.host.runner.attention_backend
        self.metrics.watch(self.status.load_report, self.all_counters)
        self.metrics_server = serve_metrics(self.config, self.metrics, self.instance)
        self.add_service(self.server)
        instance_pb2_grpc.add_InstanceServiceServicer_to_server(self.status, self.server)
        self.health = await add_standard_services(
            self.server, (self.service_name, INSTANCE_SERVICE)
        )
        if self.config.health_port is not None:
            address = f"{self.config.host}:{self.config.health_port}"
            self.health_server, self.health_port = await start_health_server(self.health, address)
            log.info("health_port_started", port=self.health_port)
        aio_loop = asyncio.get_running_loop()

        def on_rank_lost(rank: int, status: int) -> None:
            aio_loop.call_soon_threadsafe(self._go_down, rank, status)

        self.host.runner.watch_ranks(on_rank_lost)
        self.loop.start()
        if self.kv_writer is not None:
            self.kv_writer.start()
        await self.server.start()
        # NOTE: what building the instance freed (its tokenizer's parsed files among it) goes
        # back to the system before it serves.
        return_freed_memory()
        self._tasks.extend(asyncio.create_task(work) for work in self.background())
        self.registration = registration_client(
            self.config, self.security, self.instance, self.status.load_report
        )
        if self.registration is not None:
            self._tasks.append(asyncio.create_task(self.registration.run()))

    def _go_down(self, rank: int, status: int) -> None:
        """A rank is lost: the instance stops as a whole (what is in flight ends, its blocks
        and leases released) and `is_down` is set; peers see it as a lost instance."""
        log.error("instance_down", reason="tensor_parallel_rank_lost", rank=rank, status=status)

        async def stop_and_mark() -> None:
            # NOTE: the engine thread is not waited for: a step in a collective with the lost
            # rank mostly fails at once, but gloo does not always see the peer's end closed
            # (then it waits out the step timeout, 30 s by default, with nothing to gain).
            await self.stop(grace=0, engine_wait_s=LOST_RANK_ENGINE_WAIT_S)
            self.is_down.set()

        self._tasks.append(asyncio.create_task(stop_and_mark()))

    async def drain_and_stop(self, timeout_s: float | None = None) -> None:
        """Refuses new requests, lets those in flight finish (up to the timeout), then stops.

        Health turns NOT_SERVING and the instance deregisters first, so the gateway routes
        elsewhere; what is still in flight at the deadline goes to `at_drain_deadline`.
        """
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.stop_admitting()
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        if self.registration is not None:
            await self.registration.stop()
        log.info("draining", num_in_flight=self.num_in_flight())
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.num_in_flight():
            await self.at_drain_deadline()
        await self.stop(grace=1.0)

    async def stop(self, grace: float | None = None, engine_wait_s: float = 30.0) -> None:
        """Stops background tasks, registration, the server, the engine thread (waiting up to
        `engine_wait_s` for its step to end) and metrics."""
        self.stop_admitting()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if self.registration is not None:
            await self.registration.stop()
        await self.abort_in_flight()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(None)
        await self.close()
        if not self.loop.stop(timeout_s=engine_wait_s):
            log.warning("engine_thread_left_running", waited_s=engine_wait_s)
        if self.kv_writer is not None:
            await asyncio.to_thread(self.kv_writer.stop)
        if self.kv_store is not None:
            self.kv_store.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        if self._owns_host:
            self.host.runner.close()

    async def run_until_signal(self) -> None:
        """Serves until SIGTERM or SIGINT (or its supervisor's exit,
        `pdserve.common.supervisor`), then drains and stops (the body of ``serve``)."""
        stop = asyncio.Event()
        aio_loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            aio_loop.add_signal_handler(sig, stop.set)
        unwatch = watch_supervisor(aio_loop, stop.set)
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self.is_down.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        unwatch()
        for wait in waits:
            wait.cancel()
        if self.is_down.is_set():
            raise SystemExit(1)
        log.info("shutdown_requested")
        await self.drain_and_stop()
