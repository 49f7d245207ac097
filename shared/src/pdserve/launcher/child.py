"""One supervised service process: its log file, the events it logs, and its last lines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any, Protocol

from pdserve.common.supervisor import supervised_env
from pdserve.launcher.forkserver import ForkServer, ForkServerError

NUM_TAIL_LINES = 40
GROUP_DRAIN_S = 2.0
# NOTE: how long a report of an exited process waits for its last lines to reach the log (a
# thread copies them there; on a busy machine it may run well after the exit).
READ_TO_END_S = 5.0
"""How long `ChildProcess.close` lets a dead service's processes end on SIGTERM."""


class Process(Protocol):
    """What a `ChildProcess` runs on: a `subprocess.Popen`, or a service the fork server
    forked (`pdserve.launcher.forkserver.ForkedProcess`)."""

    pid: int
    stderr: IO[str] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class ChildProcess:
    """A service started as ``python -m <module> <args>``, stderr captured line by line.

    Every line goes to `log_path`; JSON lines are parsed so the supervisor can wait for events
    such as ``decode_started`` (which carries the bound address) or ``registered``. The service
    is told who supervises it (`pdserve.common.supervisor`): if this process dies without
    stopping it, it drains and stops by itself, its lines going on into `log_path`.

    Args:
        name: Short name for messages, e.g. "decode-0".
        argv: The command line.
        log_path: Where its output is written.
        env: Environment of the process (default: this one's), which also names this process
            as its supervisor.
        is_append: Add to `log_path` instead of starting it afresh (a restart).
        fork_server: Fork the service from this server instead of starting `argv` (which must
            then read ``python -m <module> <args>``); `argv` is started where it cannot fork.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        is_append: bool = False,
        fork_server: ForkServer | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.tail: deque[str] = deque(maxlen=NUM_TAIL_LINES)
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._log = log_path.open("a" if is_append else "w", buffering=1)
        self.started_at = time.monotonic()
        env = supervised_env(env)
        forked = None
        if fork_server is not None and argv[1:2] == ["-m"]:
            forked = self._fork(fork_server, argv[2], argv[3:], env)
        self.is_forked = forked is not None
        self.process: Process = forked or subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,  # Ctrl-C in the terminal reaches only the supervisor
        )
        self._reader = threading.Thread(target=self._read, name=f"{name}-log", daemon=True)
        self._reader.start()

    def _fork(
        self, server: ForkServer, module: str, args: list[str], env: dict[str, str]
    ) -> Process | None:
        """The service forked by `server`, its stderr a pipe to us; None where it could not
        fork (the caller starts `argv` instead)."""
        read_end, write_end = os.pipe()
        try:
            process = server.spawn(module, args, env, self._log.fileno(), write_end)
        except ForkServerError:
            os.close(read_end)
            return None
        finally:
            os.close(write_end)
        process.stderr = os.fdopen(read_end, "r")
        return process

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self._log.write(line)
            self.tail.append(line.rstrip("\n"))
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                with self._cond:
                    self.events.append(record)
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def wait_for_event(self, event: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """The first logged record whose ``event`` is `event` (and whose other keys equal
        `fields`, e.g. ``request_id=...``), waiting up to `timeout_s`.

        Raises:
            RuntimeError: If the process exits first or the time runs out.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for record in self.events:
                    if record.get("event") == event and all(
                        record.get(key) == value for key, value in fields.items()
                    ):
                        return record
                if self.process.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(self.describe_exit(f"exited before logging {event}"))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RuntimeError(
                        self.describe_exit(
                            f"did not log {event} {fields or ''} within {timeout_s:.0f}s"
                        )
                    )
                self._cond.wait(min(remaining, 0.2))

    def read_to_end(self, timeout_s: float = READ_TO_END_S) -> bool:
        """Once the process has exited, waits up to `timeout_s` for what it printed last to
        reach its log, `tail` and `events` (a thread copies them there, and may lag behind
        the exit); whether all of it did. Its output ends when every process holding it has
        closed it: processes it started may hold it longer."""
        if self.process.poll() is None:
            return False
        self._reader.join(timeout_s)
        return not self._reader.is_alive()

    def describe_exit(self, what: str = "exited") -> str:
        """A report of the process: `what` happened, whether it still runs (or its exit
        status), and the last lines it printed (all of them, once it has exited:
        `read_to_end`)."""
        self.read_to_end()
        code = self.process.poll()
        state = "still running" if code is None else f"status {code}"
        tail = "\n".join(f"    {line}" for line in self.tail)
        return f"{self.name} (pid {self.pid}) {what} ({state}); last output:\n{tail}"

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Kills the process if it still runs, and what it started (its session's processes,
        e.g. the gateway's parser workers, which would outlive a killed service), then closes
        its log.

        What it started is first asked to stop (SIGTERM), and given up to `GROUP_DRAIN_S` to
        be gone before it is killed: Python's resource tracker, which ignores SIGTERM, unlinks
        the named semaphores of a dead service's process pool from ``/dev/shm`` once the
        pool's processes are gone; killed with the rest, it left them there for good."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        # NOTE: the child leads its own process group (start_new_session), whose id cannot be
        # reused while any of its processes lives; a dead service's workers may still hold its
        # ports (inherited sockets), which a restart needs.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + GROUP_DRAIN_S
            while _group_runs(self.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            os.killpg(self.pid, signal.SIGKILL)
        self._reader.join(timeout=2)
        self._log.close()


def _group_runs(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies, which nothing may reap here, do
    not count)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        # NOTE: the command name, in parentheses, may hold spaces: the fields follow its end.
        state, _, group = stat[stat.rindex(")") + 2 :].split(" ", 3)[:3]
        if int(group) == pgid and state != "Z":
            return True
    return False
