"""Standard pieces of every pdserve gRPC server: health, reflection and message limits."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.common import telemetry

# NOTE: KV chunks are sized below this; 64 MiB leaves room for large prompts' token lists.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# NOTE: a connection to a peer cut off by the network stays "open" (TCP keeps retransmitting,
# ever more rarely), and a call sent on it after the network heals can wait for many seconds.
# Pings on every pdserve channel find such a connection dead within KEEPALIVE_S + its
# timeout; the channel then connects again, never waiting more than the bounded backoff, so a
# peer that comes back takes work within seconds. Servers accept such pings (below).
KEEPALIVE_MS = 5_000
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 2 * KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 2_000),
    ("grpc.max_reconnect_backoff_ms", 3_000),
)
_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    # NOTE: gRPC sets SO_REUSEPORT by default: a second server on a taken port then binds
    # too, and the kernel splits the connections between the two (a stale decode and its
    # replacement, say). Off, the second one fails to start instead (`bind`).
    ("grpc.so_reuseport", 0),
)


class ListenError(OSError):
    """A server's port cannot be bound: in use, or the address is not this host's."""

    @classmethod
    def of_socket(cls, host: str, port: int, error: OSError) -> ListenError:
        """The error of a plain socket's bind (REST, metrics, the KV data port), naming why."""
        return cls(f"cannot listen on {host}:{port}: {error.strerror}")


def bind(
    server: grpc.aio.Server,
    address: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Binds `address` (host:port, port 0 picks one) on `server`, with TLS `credentials` if
    given; returns the bound port.

    Raises:
        ListenError: It cannot be bound.
    """
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:
        # NOTE: grpcio raises "Failed to bind to address ..." (older ones returned 0).
        port = 0
    if port == 0:
        raise ListenError(
            f"cannot listen on {address}: the port is in use (another server there?) or the "
            "address is not this host's"
        )
    return port


def new_aio_server(
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    *,
    max_receive_message_bytes: int = MAX_MESSAGE_BYTES,
) -> grpc.aio.Server:
    """An aio server with pdserve's message limits (and a span per RPC when tracing is on).

    Args:
        interceptors: Server interceptors, after the tracing one.
        max_receive_message_bytes: Largest request message accepted; gRPC itself refuses a
            larger one with RESOURCE_EXHAUSTED before any handler runs.
    """
    chain = list(interceptors)
    if telemetry.is_enabled():
        chain.insert(0, telemetry.server_interceptor())
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_message_bytes),
        *_SERVER_OPTIONS,
    ]
    return grpc.aio.server(interceptors=chain, options=options)


async def add_standard_services(
    server: grpc.aio.Server, service_names: Iterable[str]
) -> health.aio.HealthServicer:
    """Registers grpc.health.v1 and server reflection for `service_names` on `server`.

    Every named service (and the overall server, "") starts SERVING. Returns the health
    servicer so the caller can flip to NOT_SERVING when it drains.
    """
    names = list(service_names)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection([*names, health_name, reflection.SERVICE_NAME], server)
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return health_servicer


async def start_health_server(
    health_servicer: health.aio.HealthServicer, address: str
) -> tuple[grpc.aio.Server, int]:
    """Serves `health_servicer` alone, in plaintext, on `address` (host:port, port 0 picks
    one); returns the started server and its bound port.

    Kubernetes' gRPC probes present no client certificate, so they cannot reach a port that
    demands mutual TLS; this port answers grpc.health.v1 and nothing else.
    """
    server = grpc.aio.server(options=list(_SERVER_OPTIONS))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = bind(server, address)
    await server.start()
    return server, port


def insecure_channel(address: str) -> grpc.aio.Channel:
    """An aio client channel with pdserve's message limits.

    Calls that continue a trace pass ``metadata=telemetry.outgoing_metadata(...)``.
    """
    return grpc.aio.insecure_channel(address, options=list(CHANNEL_OPTIONS))
