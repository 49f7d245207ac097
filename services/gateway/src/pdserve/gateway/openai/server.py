"""The REST port: the FastAPI app served by uvicorn on a socket the gateway binds itself.

The gateway binds the socket (so port 0 works and TCP_NODELAY applies, see `bind_tcp`) and
runs uvicorn as one of its tasks, without uvicorn's own signal handlers: on SIGTERM the
gateway drains first, then stops uvicorn (`RestServer.stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from pdserve.common.grpc_server import ListenError

Spawn = Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]]


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handlers (the gateway drains first, then stops it), which
    stops at once when told to: uvicorn looks at its exit flag every 0.1 s and then gives open
    connections 0.1 s more, about 0.2 s a stop for nothing when no connection is open (a
    gateway restarted by a test or an operator pays it every time)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exiting = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def exit_now(self) -> None:
        """Stops serving without waiting for requests in flight (the gateway drained them)."""
        self.should_exit = True
        self.force_exit = True
        self._exiting.set()

    async def main_loop(self) -> None:
        """uvicorn's loop of ticks (its date header once a second), woken by `exit_now`."""
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exiting.wait(), 0.1)
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown where a connection is open; else the listening sockets closed,
        without its pause for connections to close."""
        if self.server_state.connections:
            await super().shutdown(sockets)
            return
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for server in self.servers:
            await server.wait_closed()


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0 picks a free port), ready for uvicorn.

    Raises:
        ListenError: It cannot be bound.
    """
    # NOTE: proto must be IPPROTO_TCP: asyncio enables TCP_NODELAY on accepted sockets only
    # then, and without it small SSE/JSON writes wait on delayed ACKs (~40 ms each).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ListenError.of_socket(host, port, error) from error
    sock.set_inheritable(True)
    return sock


class RestServer:
    """Serves `app` over HTTP once started.

    Attributes:
        port: The bound port, once started.
    """

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.port: int | None = None
        self._uvicorn: _UvicornServer | None = None
        self._serving: asyncio.Task[Any] | None = None

    async def start(self, host: str, port: int, spawn: Spawn) -> int:
        """Binds ``host:port`` and serves on a task made by `spawn`; returns once uvicorn has
        started (raising its startup failure), with the bound port."""
        sock = bind_tcp(host, port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_config=None, access_log=False, lifespan="off", timeout_keep_alive=30
        )
        self._uvicorn = _UvicornServer(config)
        self._serving = serving = spawn(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if serving.done():
                serving.result()  # raises the startup failure
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Tells uvicorn to exit now and waits up to `timeout_s` for it."""
        if self._uvicorn is not None:
            self._uvicorn.exit_now()
        if self._serving is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._serving), timeout_s)
