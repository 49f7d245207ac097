"""A TCP port to give a server a test starts, where the server cannot take port 0 (a port
written into its configuration or another process's)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for port 0 and outgoing connections."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(hosts: tuple[str, ...] = ("127.0.0.1",), count: int = 1) -> int:
    """A port free on every one of `hosts` at the time of asking, below the kernel's ephemeral
    range: between this answer and the server's bind no outgoing connection or port-0 server
    (of this test or of another beside it) can be given it, as one from the range could (a
    chart's pod lost its metrics port so on a busy machine; a gateway restarted on the port it
    had drawn from the range found it taken). With `count`, the first of that many free ports
    in a row."""
    low = _ephemeral_low()
    candidates = range(LOWEST, low - count) if low - LOWEST >= 1000 else range(1024, low - count)
    error: OSError | None = None
    for _ in range(1000):
        port = random.choice(candidates)
        try:
            for host in hosts:
                for taken in range(port, port + count):
                    with socket.socket() as probe:
                        probe.bind((host, taken))
        except OSError as failed:
            error = failed
            continue
        return port
    raise RuntimeError(f"no free port on {hosts} below {low}: {error}")


def gateway_ports(num_gateways: int) -> tuple[int, int, int]:
    """The REST, public gRPC and internal ports to give a cluster of `num_gateways` gateways
    (gateway i listens on each plus i): one run of free ports (`free_port`) holds them all."""
    first = free_port(count=3 * num_gateways)
    return first, first + num_gateways, first + 2 * num_gateways
