"""Start-up steps every prefill and decode server shares: model, identity, metrics, registry."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

import structlog

from pdserve.common.metrics import InstanceMetrics, start_metrics_server
from pdserve.common.registration import RegistrationClient
from pdserve.serving.config import InstanceConfig
from pdserve.serving.convert import local_protocol
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import common_pb2

log = structlog.get_logger(__name__)


def load_model(config: InstanceConfig) -> ModelHost:
    """Loads the configured checkpoint (the demo model when none) and allocates the KV cache."""
    return ModelHost.load(
        config.model,
        config.served_model_name,
        num_blocks=config.num_blocks,
        kv_cache_memory_mb=config.kv_cache_memory_mb,
        block_size=config.block_size,
        dtype=config.dtype,
        device=config.device,
        max_model_len=config.max_model_len,
        num_threads=config.num_threads,
    )


def instance_info(
    config: InstanceConfig, role: common_pb2.InstanceRole, port: int, host: ModelHost
) -> common_pb2.InstanceInfo:
    """The InstanceInfo this server registers and reports (a random id unless configured)."""
    name = common_pb2.InstanceRole.Name(role).removeprefix("INSTANCE_ROLE_").lower()
    return common_pb2.InstanceInfo(
        instance_id=config.instance_id or f"{name}-{uuid.uuid4().hex[:12]}",
        role=role,
        address=config.advertise_address or f"{config.host}:{port}",
        protocol=local_protocol(),
        kv_layout=host.kv_layout,
        model_name=host.served_model_name,
        max_model_len=host.max_model_len,
    )


def serve_metrics(
    config: InstanceConfig, metrics: InstanceMetrics, instance: common_pb2.InstanceInfo
) -> WSGIServer | None:
    """Starts ``/metrics`` when ``--metrics-port`` is set and records its address in
    `instance` (so it is registered with the gateway)."""
    if config.metrics_port is None:
        return None
    server = start_metrics_server(metrics.registry, config.host, config.metrics_port)
    instance.metrics_address = f"{instance.address.rsplit(':', 1)[0]}:{server.server_port}"
    log.info("metrics_started", address=instance.metrics_address)
    return server


def registration_client(
    config: InstanceConfig,
    instance: common_pb2.InstanceInfo,
    load_report: Callable[[], common_pb2.LoadReport],
) -> RegistrationClient | None:
    """A client that keeps `instance` registered with ``--gateway``, or None without one."""
    if not config.gateway:
        return None
    return RegistrationClient(config.gateway, instance, load_report)
