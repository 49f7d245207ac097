"""A TCP port to give a server a test starts, where the server cannot take port 0 (a port
written into its configuration or another process's)."""

from __future__ import annotations

import os
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


def _worker_slice(ports: range) -> range:
    """This pytest worker's share of `ports`: xdist worker ``gw<i>`` of ``n`` draws from
    the i-th of n equal slices (all of them outside xdist), so two workers never draw the same
    port. Each starts clusters at the same moment (the suite begins with every worker's longest
    scope): two runs drawn free before either server bound them once overlapped (a fault-matrix
    gateway found its gRPC port bound by the default model's cluster on another worker)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        index, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    except (KeyError, ValueError):
        return ports
    if not 0 <= index < count:
        return ports
    size = len(ports) // count
    return ports[index * size : (index + 1) * size]


_handed_out: set[int] = set()
"""Every port this process has handed out: a run drawn twice before the first server bound it
(an etcd's client and peer ports, drawn one after the other before it starts) would collide."""


def free_port(hosts: tuple[str, ...] = ("127.0.0.1",), count: int = 1) -> int:
    """A port free on every one of `hosts` at the time of asking, below the kernel's ephemeral
    range: between this answer and the server's bind no outgoing connection or port-0 server
    (of this test or of another beside it) can be given it, as one from the range could (a
    chart's pod lost its metrics port so on a busy machine; a gateway restarted on the port it
    had drawn from the range found it taken). It comes from this pytest worker's own slice of
    that range (`_worker_slice`) and is never handed out twice by one process. With `count`,
    the first of that many free ports in a row."""
    low = _ephemeral_low()
    share = _worker_slice(range(LOWEST if low - LOWEST >= 1000 else 1024, low))
    candidates = range(share.start, share.stop - count)
    error: OSError | None = None
    for _ in range(1000):
        port = random.choice(candidates)
        run = range(port, port + count)
        if _handed_out.intersection(run):
            continue
        try:
            for host in hosts:
                for taken in run:
                    with socket.socket() as probe:
                        probe.bind((host, taken))
        except OSError as failed:
            error = failed
            continue
        _handed_out.update(run)
        return port
    raise RuntimeError(f"no free port on {hosts} in {candidates}: {error}")


def gateway_ports(num_gateways: int) -> tuple[int, int, int]:
    """The REST, public gRPC and internal ports to give a cluster of `num_gateways` gateways
    (gateway i listens on each plus i): one run of free ports (`free_port`) holds them all."""
    first = free_port(count=3 * num_gateways)
    return first, first + num_gateways, first + 2 * num_gateways
