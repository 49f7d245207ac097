"""A TCP port to give a server a test starts."""

from __future__ import annotations

import socket


def free_port(hosts: tuple[str, ...] = ("127.0.0.1",)) -> int:
    """A port free on every one of `hosts` at the time of asking."""
    while True:
        with socket.socket() as first:
            first.bind((hosts[0], 0))
            port = int(first.getsockname()[1])
            try:
                for host in hosts[1:]:
                    with socket.socket() as other:
                        other.bind((host, port))
            except OSError:
                continue
        return port
