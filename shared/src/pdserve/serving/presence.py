"""How an instance makes itself known: the InstanceInfo it reports and registers
(`instance_info`, its id prefixed by `role_name`), its ``/metrics`` endpoint (`serve_metrics`,
whose address goes into that InstanceInfo) and the client that keeps it registered with
``--gateway`` or in ``--registry`` (`registration_client`). `InstanceServer` calls them once.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

import structlog

from pdserve.common.etcd_registration import EtcdRegistrationClient
from pdserve.common.etcd_registry import EtcdTarget
from pdserve.common.metrics import InstanceMetrics, start_metrics_server
from pdserve.common.registration import RegistrationClient
from pdserve.common.security import Security
from pdserve.serving.config import InstanceConfig
from pdserve.serving.convert import local_protocol
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import common_pb2

log = structlog.get_logger(__name__)


def role_name(role: common_pb2.InstanceRole) -> str:
    """``INSTANCE_ROLE_PREFILL`` -> ``prefill`` (the role's name in certificates)."""
    return common_pb2.InstanceRole.Name(role).removeprefix("INSTANCE_ROLE_").lower()


def instance_info(
    config: InstanceConfig,
    role: common_pb2.InstanceRole,
    port: int,
    host: ModelHost,
    instance_id: str | None = None,
) -> common_pb2.InstanceInfo:
    """The InstanceInfo this server registers and reports (a random id unless given)."""
    return common_pb2.InstanceInfo(
        instance_id=instance_id or f"{role_name(role)}-{uuid.uuid4().hex[:12]}",
        role=role,
        address=config.advertise_address or f"{config.host}:{port}",
        protocol=local_protocol(),
        kv_layout=host.kv_layout,
        model_name=host.served_model_name,
        max_model_len=host.max_model_len,
        tensor_parallel_size=host.runner.tensor_parallel_size,
        batch_invariant=host.is_batch_invariant,
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
    security: Security,
    instance: common_pb2.InstanceInfo,
    load_report: Callable[[], common_pb2.LoadReport],
) -> RegistrationClient | EtcdRegistrationClient | None:
    """A client that keeps `instance` registered with ``--gateway`` or in ``--registry``,
    or None without either."""
    if config.registry is not None:
        return EtcdRegistrationClient(
            EtcdTarget.parse(config.registry),
            instance,
            load_report,
            config.registry_ttl_s,
            config.heartbeat_interval_s,
        )
    if not config.gateway:
        return None
    return RegistrationClient(config.gateway, instance, load_report, security)
