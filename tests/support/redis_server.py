"""A real redis-server on 127.0.0.1 for tests: no persistence, its own temp dir, a free port;
or on a test host of `support.netns` (its address, reached over the test network)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from support.netns import Host
from support.ports import free_port

_START_TIMEOUT_S = 10.0


def _answers_ping(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process; `stop` may be called mid-test to take the store down.

    Args:
        on: The test host it runs on (bound to its address), or None: 127.0.0.1 here.
    """

    def __init__(self, workdir: Path, on: Host | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed: `make test` installs it (make system-deps), "
                "or run `apt-get install -y redis-server`",
                pytrace=False,
            )
        self._binary = binary
        self._workdir = workdir
        self._on = on
        # NOTE: a test host's namespace has nothing listening: a port free here is free there.
        self.address = on.address if on is not None else "127.0.0.1"
        self.port = free_port()
        self.spec = f"redis://{self.address}:{self.port}/0"
        self.start()

    def start(self) -> None:
        """Starts the server (again, on the same port, empty) and waits until it answers."""
        self._log = open(self._workdir / "redis.log", "ab")  # noqa: SIM115
        argv = [self._binary, "--port", str(self.port), "--bind", self.address, "--save", "",
                "--appendonly", "no", "--dir", str(self._workdir)]  # fmt: skip
        if self._on is not None:
            # NOTE: without a password redis answers only loopback clients unless told to.
            argv += ["--protected-mode", "no"]
        self._process = subprocess.Popen(
            self._on.command(argv) if self._on is not None else argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _answers_ping(self.address, self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = (self._workdir / "redis.log").read_text(errors="replace")
                pytest.fail(f"redis-server did not answer PING on port {self.port}:\n{log}")
            time.sleep(0.02)

    @property
    def is_running(self) -> bool:
        return self._process.poll() is None

    def stop(self) -> None:
        """Stops the server and waits until it has exited."""
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()


@contextmanager
def running_redis(workdir: Path, on: Host | None = None) -> Iterator[RedisServer]:
    """A redis-server (on test host `on`, if given) for the duration of the block (stopped at
    the end even if it failed)."""
    server = RedisServer(workdir, on)
    try:
        yield server
    finally:
        server.stop()
