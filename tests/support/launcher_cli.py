"""`pdserve up` run as a user runs it, a command in its own process: its banner (URLs, each
service's pid) and the events it logs on stderr (``service_exited``, ``service_restarted``...)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO

BANNER_END = "Press Ctrl-C to stop."
_FIELD = re.compile(r"(\w+)=(\S+)")


class LauncherCli:
    """A running ``python -m pdserve.launcher up ARGS`` whose output is read as it comes.

    Args:
        args: The flags after ``up``.
    """

    def __init__(self, args: Sequence[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.launcher", "up", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._cond = threading.Condition()
        assert self.process.stdout is not None and self.process.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.process.stdout, self.stdout),
                                  (self.process.stderr, self.stderr))
        ]  # fmt: skip
        for reader in self._readers:
            reader.start()

    def _read(self, stream: IO[str], lines: list[str]) -> None:
        for line in stream:
            with self._cond:
                lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_banner(self, timeout_s: float) -> list[str]:
        """The banner's lines, once printed.

        Raises:
            AssertionError: If the launcher exits first or the time runs out.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not any(BANNER_END in line for line in self.stdout):
                remaining = deadline - time.monotonic()
                exited = self.process.poll() is not None
                assert not exited and remaining > 0, "no banner:\n" + "\n".join(self.stderr[-40:])
                self._cond.wait(min(remaining, 0.2))
            return list(self.stdout)

    @property
    def rest_urls(self) -> list[str]:
        """Each gateway's REST base URL (without ``/v1``), from the banner."""
        line = next(line for line in self.stdout if "REST (OpenAI API):" in line)
        return [url.removesuffix("/v1") for url in line.split(": ", 1)[1].split()]

    @property
    def pids(self) -> dict[str, int]:
        """Each service's pid as the banner printed it, by name."""
        line = next(line for line in self.stdout if line.strip().startswith("Processes:"))
        named = line.split(": ", 1)[1].split(", ")
        return {name: int(pid) for name, pid in (entry.split() for entry in named)}

    def events(self, event: str) -> list[dict[str, str]]:
        """The fields of each line the launcher logged with this event name, so far."""
        with self._cond:
            lines = list(self.stderr)
        return [dict(_FIELD.findall(line)) for line in lines if f" {event} " in f"{line} "]

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, as an operator stops it; its exit status (killed if it does not stop)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            for reader in self._readers:
                reader.join(timeout=5)


@contextmanager
def running_launcher(args: Sequence[str], stop_timeout_s: float = 60.0) -> Iterator[LauncherCli]:
    """A `LauncherCli` for the block, stopped (SIGTERM) at its end."""
    launcher = LauncherCli(args)
    try:
        yield launcher
    finally:
        if launcher.process.poll() is None:
            launcher.stop(stop_timeout_s)
