"""The gateway's two gRPC ports: the public one (GenerationService, API keys, no client
certificates) and the internal one (RegistryService behind mutual TLS and the role table unless
``--insecure``), each with health and reflection; 0 picks a free port."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from grpc_health.v1 import health_pb2

from pdserve.common.authz import AuthorizationInterceptor
from pdserve.common.grpc_server import add_standard_services, bind, new_aio_server
from pdserve.common.security import Security
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.fleet.registry_servicer import RegistryServicer
from pdserve.gateway.grpc_api import servicer
from pdserve.v1 import generation_pb2, registry_pb2, registry_pb2_grpc

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
REGISTRY_SERVICE = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def start_public_grpc(
    config: GatewayConfig,
    generation: servicer.GenerationServicer,
    update_readiness: Callable[[], Awaitable[None]],
) -> tuple[Any, Any, int]:
    """Starts the public port; GenerationService's health starts NOT_SERVING and is then set by
    `update_readiness`.

    Returns:
        The server, its health servicer and the bound port.

    Raises:
        ListenError: The port cannot be bound.
    """
    server = new_aio_server(max_receive_message_bytes=config.grpc_max_receive_bytes)
    servicer.add_to_server(generation, server)
    health = await add_standard_services(server, (GENERATION_SERVICE,))
    await health.set(GENERATION_SERVICE, NOT_SERVING)
    await update_readiness()
    port = bind(server, f"{config.host}:{config.grpc_port}")
    await server.start()
    return server, health, port


async def start_internal_grpc(
    config: GatewayConfig, security: Security, registry: RegistryServicer
) -> tuple[Any, int]:
    """Starts the internal port: RegistryService (and health), behind mTLS and the role table.

    Returns:
        The server and the bound port.

    Raises:
        ListenError: The port cannot be bound.
    """
    guard = [] if security.is_insecure else [AuthorizationInterceptor()]
    server = new_aio_server(guard, max_receive_message_bytes=config.grpc_max_receive_bytes)
    registry_pb2_grpc.add_RegistryServiceServicer_to_server(registry, server)
    await add_standard_services(server, (REGISTRY_SERVICE,))
    port = security.bind(server, f"{config.host}:{config.internal_port}")
    await server.start()
    return server, port
