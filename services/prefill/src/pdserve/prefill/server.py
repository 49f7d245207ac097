"""Builds and runs a prefill instance: `create_server(config)` then `serve(config)`."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import grpc
import structlog
from grpc_health.v1 import health

from pdserve.common import env
from pdserve.common.grpc_server import add_standard_services, new_aio_server
from pdserve.common.metrics import CounterSource
from pdserve.common.registration import RegistrationClient
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.convert import RequestLimits
from pdserve.prefill.decode_client import DecodePeers
from pdserve.prefill.metrics import PrefillMetrics
from pdserve.prefill.pipeline import Pipeline
from pdserve.prefill.prefill_loop import PrefillLoop
from pdserve.prefill.servicer import PrefillServicer
from pdserve.prefill.status import PrefillStatus
from pdserve.serving.instance import (
    instance_info,
    load_model,
    registration_client,
    serve_metrics,
)
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import common_pb2, instance_pb2, instance_pb2_grpc, prefill_pb2, prefill_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAMES = (
    prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name,
    instance_pb2.DESCRIPTOR.services_by_name["InstanceService"].full_name,
)


@dataclass
class PrefillInstance:
    """A running prefill server and its parts (what tests and `serve` hold on to)."""

    config: PrefillConfig
    server: grpc.aio.Server
    port: int
    host: ModelHost
    loop: PrefillLoop
    peers: DecodePeers
    pipeline: Pipeline
    servicer: PrefillServicer
    status: PrefillStatus
    health: health.aio.HealthServicer
    registration: RegistrationClient | None
    _tasks: list[asyncio.Task[None]]
    metrics_server: WSGIServer | None = None

    @property
    def address(self) -> str:
        return self.status.instance.address

    async def drain_and_stop(self, timeout_s: float | None = None) -> None:
        """Refuses new requests, lets those in flight finish (up to the timeout), then stops.

        Requests still in flight at the deadline are aborted, which releases their leases.
        """
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.pipeline.is_draining = True
        await self.health.enter_graceful_shutdown()
        if self.registration is not None:
            await self.registration.stop()
        log.info("draining", num_requests=len(self.pipeline.live))
        deadline = time.monotonic() + timeout_s
        while self.pipeline.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.stop(grace=1.0)

    async def stop(self, grace: float | None = None) -> None:
        """Aborts what is in flight, stops the server, background tasks and the engine thread."""
        self.pipeline.is_draining = True
        for task in self._tasks:
            task.cancel()
        if self.registration is not None:
            await self.registration.stop()
        await self.pipeline.abort_all()
        await self.server.stop(grace)
        await self.peers.close()
        self.loop.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()


async def create_server(config: PrefillConfig, host: ModelHost | None = None) -> PrefillInstance:
    """Loads the model (unless `host` is given), binds the port and starts serving.

    Args:
        config: Settings.
        host: An already loaded model to reuse (tests and benchmarks load one per server).
    """
    host = host or load_model(config)
    server = new_aio_server()
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        raise OSError(f"cannot bind {config.host}:{config.port}")
    instance = instance_info(config, common_pb2.INSTANCE_ROLE_PREFILL, port, host)
    loop = PrefillLoop(host.runner, config.max_num_batched_tokens, config.max_chunk_bytes)
    peers = DecodePeers(
        instance.instance_id,
        host.kv_layout,
        config.prepare_concurrency,
        config.allocate_timeout_ms / 1000,
    )
    fault = env.fault_corrupt_kv()
    pipeline = Pipeline(
        loop, peers, host.eos_token_ids, host.max_model_len, config.max_queue_len, fault
    )
    limits = RequestLimits(
        vocab_size=host.runner.model_config.vocab_size,
        max_model_len=host.max_model_len,
        max_prompt_blocks=host.num_blocks,
        block_size=host.runner.block_size,
    )
    servicer = PrefillServicer(host, pipeline, instance, limits)
    status = PrefillStatus(instance, pipeline, loop)
    metrics = PrefillMetrics()
    loop.metrics = pipeline.metrics = metrics
    metrics.watch(status.load_report, _counters(loop, pipeline))
    metrics_server = serve_metrics(config, metrics, instance)
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    instance_pb2_grpc.add_InstanceServiceServicer_to_server(status, server)
    health_servicer = await add_standard_services(server, SERVICE_NAMES)
    loop.start()
    await server.start()
    tasks: list[asyncio.Task[None]] = []
    registration = registration_client(config, instance, status.load_report)
    if registration is not None:
        tasks.append(asyncio.create_task(registration.run()))
    if fault is not None:
        log.warning("fault_injection_enabled", fault="corrupt_kv", request_id_pattern=fault)
    log.info(
        "prefill_started",
        address=instance.address,
        instance_id=instance.instance_id,
        num_blocks=host.num_blocks,
        block_size=host.runner.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        model=host.served_model_name,
    )
    return PrefillInstance(
        config,
        server,
        port,
        host,
        loop,
        peers,
        pipeline,
        servicer,
        status,
        health_servicer,
        registration,
        tasks,
        metrics_server=metrics_server,
    )


def _counters(loop: PrefillLoop, pipeline: Pipeline) -> CounterSource:
    def read() -> dict[str, tuple[str, float]]:
        return {
            "prompt_tokens": (
                "Prompt tokens prefilled (rate() gives tokens/s).",
                loop.num_prompt_tokens,
            ),
            "passes": ("Prefill forward passes run.", loop.num_passes),
            "handed_off": ("Requests whose KV the decode acknowledged.", pipeline.num_handed_off),
            "kv_sent_bytes": ("KV bytes in acknowledged transfers.", pipeline.num_kv_bytes_sent),
        }

    return read


async def serve(config: PrefillConfig) -> None:
    """Runs a prefill instance until SIGTERM/SIGINT, then drains and exits."""
    instance = await create_server(config)
    stop = asyncio.Event()
    aio_loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aio_loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutdown_requested")
    await instance.drain_and_stop()
    log.info("prefill_stopped")
