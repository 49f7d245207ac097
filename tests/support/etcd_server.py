"""A real single-member etcd for tests, on 127.0.0.1, another local address or a test host of
`support.netns` (its address): its own data
dir, free client and peer ports; `stop` and `start` again (same ports, same data) simulate an
etcd restart, `freeze` a hung one."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from support.netns import Host
from support.ports import free_port

_START_TIMEOUT_S = 20.0


def _is_healthy(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=0.5) as response:
            return bool(json.loads(response.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


class EtcdServer:
    """One etcd process listening on `host` (or on test host `on`, at its address); `spec` is
    what ``--registry`` takes."""

    def __init__(self, workdir: Path, host: str = "127.0.0.1", on: Host | None = None) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.fail(
                "etcd is not installed: `make test` installs it (make system-deps), "
                "or run `apt-get install -y etcd-server`",
                pytrace=False,
            )
        self._binary = binary
        self._workdir = workdir
        self._on = on
        self.host = on.address if on is not None else host
        # NOTE: a test host's namespace has nothing listening: ports free here are free there.
        self.port = free_port((host,))
        self.peer_port = free_port((host,))
        self.spec = f"etcd://{self.host}:{self.port}"
        self._process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Starts etcd (again) and waits until it reports healthy."""
        client = f"http://{self.host}:{self.port}"
        peer = f"http://{self.host}:{self.peer_port}"
        log = open(self._workdir / "etcd.log", "ab")  # noqa: SIM115
        argv = [self._binary, "--name", "test", "--data-dir", str(self._workdir / "etcd-data"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}", "--log-level", "warn"]  # fmt: skip
        self._process = subprocess.Popen(
            self._on.command(argv) if self._on is not None else argv,
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _is_healthy(self.host, self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                text = (self._workdir / "etcd.log").read_text(errors="replace")
                pytest.fail(f"etcd did not become healthy on port {self.port}:\n{text[-4000:]}")
            time.sleep(0.05)

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def freeze(self, is_frozen: bool = True) -> None:
        """SIGSTOPs etcd (connections stay open but nothing answers), or SIGCONTs it."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP if is_frozen else signal.SIGCONT)

    def stop(self) -> None:
        """Stops etcd and waits until it has exited (its data stays for a restart)."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def running_etcd(
    workdir: Path, host: str = "127.0.0.1", on: Host | None = None
) -> Iterator[EtcdServer]:
    """An etcd on `host` (or on test host `on`) for the duration of the block (stopped at the
    end even if it failed)."""
    server = EtcdServer(workdir, host, on)
    try:
        yield server
    finally:
        server.stop()
