"""A server port that is taken fails the start with `ListenError`, naming the address: never
shared with the server already there (gRPC's default SO_REUSEPORT would share it, and the
kernel would split the connections between the two)."""

from __future__ import annotations

import socket

import pytest
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry

from pdserve.common.grpc_server import ListenError, new_aio_server, start_health_server
from pdserve.common.metrics import start_metrics_server
from pdserve.common.security import Security
from pdserve.gateway.openai.server import bind_tcp


async def test_a_second_grpc_server_cannot_take_a_port_in_use() -> None:
    first = new_aio_server()
    port = Security(None).bind(first, "127.0.0.1:0")
    await first.start()
    try:
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}: the port"):
            Security(None).bind(new_aio_server(), f"127.0.0.1:{port}")
        with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}"):
            await start_health_server(health.aio.HealthServicer(), f"127.0.0.1:{port}")
    finally:
        await first.stop(None)


def test_rest_and_metrics_ports_in_use_say_so() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}: Address already in use"):
            bind_tcp("127.0.0.1", port)
        with pytest.raises(ListenError, match=f"127.0.0.1:{port}: Address already in use"):
            start_metrics_server(CollectorRegistry(), "127.0.0.1", port)
