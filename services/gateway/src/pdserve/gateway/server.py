"""Assembles a gateway: registry, router, orchestrator, REST app and gRPC servers.

`create_server(config)` builds everything without binding; `GatewayServer.start()` binds the
REST port (`pdserve.gateway.openai.server`), the public gRPC port (GenerationService) and the
internal one (RegistryService, mutual TLS unless ``--insecure``), 0 picking free ones, and
starts the background loops (TTL sweep, static instance polling, the etcd watcher with
``--registry``); `stop()` drains: health NOT_SERVING, new requests refused, running ones given
``shutdown_grace_s`` to finish (``pdserve-gateway`` runs one until SIGTERM).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import structlog
from fastapi import FastAPI
from grpc_health.v1 import health_pb2

from pdserve.common import env
from pdserve.common.etcd_registry import EtcdTarget
from pdserve.common.security import Security
from pdserve.gateway.access.admission import ConcurrencyLimiter, RateLimiter
from pdserve.gateway.access.api_keys import ApiKeyStore
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.decisions import RetryPolicy
from pdserve.gateway.fleet.clients import GrpcBackend
from pdserve.gateway.fleet.etcd_watcher import EtcdWatcher
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.fleet.liveness import LivenessClock
from pdserve.gateway.fleet.model_info import ModelInfoStore
from pdserve.gateway.fleet.poller import StaticPoller
from pdserve.gateway.fleet.registry import InstanceEntry, Registry
from pdserve.gateway.fleet.registry_servicer import RegistryServicer
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.grpc_api import servicer
from pdserve.gateway.grpc_ports import (
    GENERATION_SERVICE,
    NOT_SERVING,
    start_internal_grpc,
    start_public_grpc,
)
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai.api import create_app as create_rest_app
from pdserve.gateway.openai.server import RestServer
from pdserve.gateway.orchestrator import Orchestrator
from pdserve.gateway.prepare.workers import ParserPool, WorkerPool
from pdserve.gateway.routing.router import Router
from pdserve.gateway.session.etcd_store import EtcdResumeStore
from pdserve.gateway.session.runs import Runs
from pdserve.gateway.session.sessions import Sessions
from pdserve.gateway.session.store import MemoryResumeStore, ResumeStore
from pdserve.gateway.streaming import Streamer

log = structlog.get_logger("pdserve.gateway.server")


class GatewayServer:
    """One gateway: every part, plus the REST and gRPC servers that expose them.

    Args:
        config: Settings.
        backend: Client of prefill/decode instances (a `GrpcBackend` by default).
        security: The internal plane's credentials; from the config's TLS flags when None.
    """

    def __init__(
        self,
        config: GatewayConfig,
        backend: GrpcBackend | None = None,
        security: Security | None = None,
    ) -> None:
        self.config = config
        self.security = security or Security.from_config(config, "gateway")
        self.metrics = GatewayMetrics()
        self.liveness_clock = LivenessClock()
        self.registry = Registry(config.instance_ttl_s, self.liveness_clock)
        self.router = Router(
            self.registry,
            config.unavailable_retry_after_s,
            cache_routing=config.cache_routing(),
        )
        self.backend = backend or GrpcBackend(self.security)
        self.model_infos = ModelInfoStore(self.backend.get_model_files, config.tokenizer)
        policy = RetryPolicy(
            max_attempts=config.max_attempts,
            preempt_retry_count=config.preempt_retry_count,
            preempt_retry_exclude_decode=config.preempt_retry_exclude_decode,
            peer_wait_s=config.peer_wait_s,
        )
        self.orchestrator = Orchestrator(
            self.backend,
            self.router,
            self.registry,
            policy,
            self.metrics,
            queue_limits=config.queue_limits(),
        )
        self.workers = WorkerPool(config.prepare_workers, config.prepare_timeout_s)
        self.parser = ParserPool(config.parse_processes, config.prepare_timeout_s)
        self.api_keys = ApiKeyStore.from_settings(
            config.api_key, config.api_key_file, env.api_keys()
        )
        self.limiter = ConcurrencyLimiter(
            config.max_concurrent_requests,
            config.max_concurrent_requests_per_key,
            rate=RateLimiter(config.requests_per_minute_per_key),
        )
        self.streamer = Streamer(self.orchestrator, self.metrics, config.request_timeout)
        self.frontend = Frontend(
            self.registry,
            self.router,
            self.model_infos,
            workers=self.workers,
            limits=config.request_limits(),
            default_max_tokens=config.default_max_tokens,
            default_chat_max_tokens=config.default_chat_max_tokens,
            tool_call_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
        )
        self.resume_store: ResumeStore = (
            EtcdResumeStore(
                EtcdTarget.parse(config.registry),
                config.max_stored_responses,
                config.resume_holder_ttl_s,
            )
            if config.registry is not None
            else MemoryResumeStore(config.max_stored_responses)
        )
        self.runs = Runs(
            self.resume_store,
            self.streamer,
            self.metrics,
            config.request_timeout,
            config.response_keep_s,
        )
        self.sessions = Sessions(self.streamer, self.frontend, self.runs, self.backend)
        self.app: FastAPI = create_rest_app(
            self.frontend,
            self.streamer,
            self.metrics,
            limiter=self.limiter,
            parser=self.parser,
            max_body_bytes=config.max_body_bytes,
            api_keys=self.api_keys,
            trace_polls=config.trace_polls,
            internal_plane="insecure" if self.security.is_insecure else "mtls",
            sessions=self.sessions,
        )
        self.poller = StaticPoller(
            self.registry,
            [(a, InstanceRole.PREFILL) for a in config.prefill]
            + [(a, InstanceRole.DECODE) for a in config.decode],
            self.backend.get_instance_status,
            self.backend.is_serving,
            config.poll_interval_s,
        )
        # NOTE: with --registry etcd://... instances join through etcd; RegistryService stays
        # on the internal port for instances that register with this gateway alone.
        self.etcd_watcher = (
            EtcdWatcher(
                self.registry,
                EtcdTarget.parse(config.registry),
                min(config.heartbeat_interval_s, config.instance_ttl_s / 4),
            )
            if config.registry is not None
            else None
        )
        self.registry.add_listener(self._on_instance_joined)
        self.registry.add_listener(lambda _: self._spawn_readiness_update())
        self.registry.add_lost_listener(
            lambda entry: self.metrics.instances_lost.labels(role=entry.info.role.value).inc()
        )
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.internal_port: int | None = None
        self._grpc_server: Any = None
        self._internal_server: Any = None
        self._health: Any = None
        self._is_ready = False
        self._rest = RestServer(self.app)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._adopting: asyncio.Task[Any] | None = None

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _on_instance_joined(self, entry: InstanceEntry) -> None:
        """Fetches a new prefill's tokenizer ahead of the first request for its model."""
        info = entry.info
        if info.role is not InstanceRole.PREFILL or self.model_infos.cached(info.model_name):
            return
        with contextlib.suppress(RuntimeError):  # no running loop: the first request fetches
            self._spawn(self._prefetch(info.model_name, info.address))

    async def _prefetch(self, model_name: str, address: str) -> None:
        with contextlib.suppress(Exception):
            await self.model_infos.get(model_name, [address])

    async def _sweep(self) -> None:
        interval_s = min(1.0, self.config.instance_ttl_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            self.registry.drop_expired()
            await self._update_readiness()

    def _spawn_readiness_update(self) -> None:
        with contextlib.suppress(RuntimeError):  # no running loop: the next sweep updates
            self._spawn(self._update_readiness())

    async def _update_readiness(self) -> None:
        """gRPC health of GenerationService: SERVING only while some model has a pair."""
        is_ready = bool(self.frontend.list_models()) and not self.frontend.is_draining
        if self._health is None or is_ready == self._is_ready or self.frontend.is_draining:
            return
        self._is_ready = is_ready
        status = health_pb2.HealthCheckResponse.SERVING if is_ready else NOT_SERVING
        await self._health.set(GENERATION_SERVICE, status)
        log.info("gateway_readiness_changed", is_ready=is_ready)

    async def start(self) -> None:
        """Binds every port and starts serving (ports are in `http_port`, `grpc_port` and
        `internal_port`)."""
        config = self.config
        # NOTE: heartbeats must not look late because the loop was busy: start the clock first.
        self._spawn(self.liveness_clock.run())
        generation = servicer.GenerationServicer(
            self.frontend, self.sessions, self.limiter, self.parser, self.api_keys
        )
        self._grpc_server, self._health, self.grpc_port = await start_public_grpc(
            config, generation, self._update_readiness
        )
        self._internal_server, self.internal_port = await start_internal_grpc(
            config, self.security, RegistryServicer(self.registry, config.heartbeat_interval_s)
        )

        self.http_port = await self._rest.start(config.host, config.port, self._spawn)

        if config.prefill or config.decode:
            await self.poller.poll_once()
            self._spawn(self.poller.run())
        if self.etcd_watcher is not None:
            self._spawn(self.etcd_watcher.run())
        if isinstance(self.resume_store, EtcdResumeStore):
            # NOTE: this gateway's requests are its own while its key lives; it adopts those
            # of a gateway whose key is gone, looking a few times per TTL.
            self.resume_store.hold()
            adopt_interval_s = min(5.0, max(0.25, config.resume_holder_ttl_s / 4))
            self._adopting = self._spawn(self.sessions.keep_adopting(adopt_interval_s))
        self._spawn(self._sweep())
        log.info(
            "gateway_started",
            host=config.host,
            http_port=self.http_port,
            grpc_port=self.grpc_port,
            internal_port=self.internal_port,
            internal_plane=self.security.describe(),
            static_prefill=list(config.prefill),
            static_decode=list(config.decode),
            registry=config.registry or "embedded",
            tokenizer=config.tokenizer,
        )

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains and stops: refuses new requests, waits for running ones, closes everything.

        Args:
            grace_s: Seconds running requests get; defaults to ``shutdown_grace_s``.
        """
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.frontend.is_draining = True
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        log.info("gateway_draining", num_active_requests=self.streamer.num_active_requests)
        if self._adopting is not None:
            self._adopting.cancel()  # NOTE: a leaving gateway takes nothing more on
        # NOTE: resumable requests are not waited for: the other gateways resume them.
        await self.runs.leave(hand_over=self.config.registry is not None)
        if not await self.streamer.wait_idle(grace_s):
            log.warning(
                "gateway_drain_timeout", num_active_requests=self.streamer.num_active_requests
            )
        await self._rest.stop(5.0)
        await self.resume_store.close()
        for grpc_server in (self._grpc_server, self._internal_server):
            if grpc_server is not None:
                await grpc_server.stop(0.5)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.orchestrator.wait_for_cleanups(), 2.0)
        self.workers.shutdown()
        self.parser.shutdown()
        await self.backend.close()
        log.info("gateway_stopped")


def create_server(config: GatewayConfig) -> GatewayServer:
    """Builds a gateway without binding anything (call `start()`)."""
    return GatewayServer(config)


def create_app(config: GatewayConfig) -> FastAPI:
    """The REST application of a new, unstarted gateway (for ASGI servers and tests)."""
    return create_server(config).app
