"""Builds and runs a decode instance: `create_server(config)` then `serve(config)`."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import grpc
import structlog
from grpc_health.v1 import health

from pdserve.common.grpc_server import add_standard_services, new_aio_server
from pdserve.common.metrics import CounterSource
from pdserve.common.registration import RegistrationClient
from pdserve.decode.config import DecodeConfig
from pdserve.decode.decode_loop import DecodeLoop, PreemptionReason
from pdserve.decode.leases import LeaseManager
from pdserve.decode.metrics import DecodeMetrics
from pdserve.decode.servicer import DecodeServicer, run_expiry_sweeper
from pdserve.decode.status import DecodeStatus
from pdserve.engine.block_pool import BlockPool
from pdserve.serving.instance import (
    instance_info,
    load_model,
    registration_client,
    serve_metrics,
)
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, instance_pb2, instance_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAMES = (
    decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name,
    instance_pb2.DESCRIPTOR.services_by_name["InstanceService"].full_name,
)


@dataclass
class DecodeInstance:
    """A running decode server and its parts (what tests and `serve` hold on to)."""

    config: DecodeConfig
    server: grpc.aio.Server
    port: int
    host: ModelHost
    leases: LeaseManager
    loop: DecodeLoop
    servicer: DecodeServicer
    status: DecodeStatus
    health: health.aio.HealthServicer
    registration: RegistrationClient | None
    _tasks: list[asyncio.Task[None]]
    metrics_server: WSGIServer | None = None

    @property
    def address(self) -> str:
        return self.status.instance.address

    async def drain_and_stop(self, timeout_s: float | None = None) -> None:
        """Refuses new leases, lets running requests finish (up to the timeout), then stops.

        Requests still running at the deadline are preempted with a DRAINING notice so the
        gateway can continue them elsewhere.
        """
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.leases.is_draining = True
        await self.health.enter_graceful_shutdown()
        if self.registration is not None:
            await self.registration.stop()
        log.info("draining", num_open_leases=len(self.leases.open_leases()))
        deadline = time.monotonic() + timeout_s
        while self.leases.open_leases() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.leases.open_leases():
            self.loop.preempt_all(PreemptionReason.DRAINING)
            await asyncio.sleep(0.2)  # let the notices reach their streams
        await self.stop(grace=1.0)

    async def stop(self, grace: float | None = None) -> None:
        """Stops the server, background tasks and the decode thread."""
        for task in self._tasks:
            task.cancel()
        if self.registration is not None:
            await self.registration.stop()
        await self.server.stop(grace)
        self.loop.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()


async def create_server(config: DecodeConfig, host: ModelHost | None = None) -> DecodeInstance:
    """Loads the model (unless `host` is given), binds the port and starts serving.

    Args:
        config: Settings.
        host: An already loaded model to reuse (tests share one across servers).
    """
    host = host or load_model(config)
    leases = LeaseManager(
        BlockPool(host.num_blocks),
        host.runner.block_size,
        config.reserve_tokens,
        config.lease_ttl_ms / 1000,
        config.capacity_retry_ms / 1000,
    )
    metrics = DecodeMetrics()
    loop = DecodeLoop(
        host.runner, leases, config.max_num_seqs, host.eos_token_ids, host.max_model_len, metrics
    )
    servicer = DecodeServicer(host, leases, loop, metrics)
    server = new_aio_server()
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot bind {config.host}:{config.port}")
    instance = instance_info(config, common_pb2.INSTANCE_ROLE_DECODE, port, host)
    servicer.instance_id = instance.instance_id
    status = DecodeStatus(instance, leases, loop)
    metrics.watch(status.load_report, _counters(leases, loop, servicer))
    metrics_server = serve_metrics(config, metrics, instance)
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    instance_pb2_grpc.add_InstanceServiceServicer_to_server(status, server)
    health_servicer = await add_standard_services(server, SERVICE_NAMES)
    loop.start()
    await server.start()
    sweep_interval_s = min(1.0, config.lease_ttl_ms / 1000 / 10)
    tasks = [asyncio.create_task(run_expiry_sweeper(servicer, sweep_interval_s))]
    registration = registration_client(config, instance, status.load_report)
    if registration is not None:
        tasks.append(asyncio.create_task(registration.run()))
    log.info(
        "decode_started",
        address=instance.address,
        instance_id=instance.instance_id,
        num_blocks=host.num_blocks,
        block_size=host.runner.block_size,
        model=host.served_model_name,
    )
    return DecodeInstance(
        config,
        server,
        port,
        host,
        leases,
        loop,
        servicer,
        status,
        health_servicer,
        registration,
        tasks,
        metrics_server=metrics_server,
    )


def _counters(leases: LeaseManager, loop: DecodeLoop, servicer: DecodeServicer) -> CounterSource:
    def read() -> dict[str, tuple[str, float]]:
        return {
            "generated_tokens": ("Tokens generated by decode steps.", loop.num_generated_tokens),
            "steps": ("Batched decode steps run.", loop.num_steps),
            "preemptions": ("Requests preempted for lack of blocks.", loop.num_preemptions),
            "leases_granted": ("Leases granted by AllocateBlocks.", leases.num_granted),
            "leases_refused": ("AllocateBlocks refused for capacity.", leases.num_refused),
            "lease_expiries": ("Leases reclaimed after their TTL.", leases.num_expired),
            "kv_received_bytes": (
                "KV bytes received in committed transfers.",
                servicer.num_kv_bytes_received,
            ),
        }

    return read


async def serve(config: DecodeConfig) -> None:
    """Runs a decode instance until SIGTERM/SIGINT, then drains and exits."""
    instance = await create_server(config)
    stop = asyncio.Event()
    aio_loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio_loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutdown_requested")
    await instance.drain_and_stop()
    log.info("decode_stopped")
