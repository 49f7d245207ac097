"""Services forked from one process that imported their modules once: pages shared, quick starts.

Each service of ``pdserve up`` used to start as its own ``python -m pdserve.<service>``, and each
imported torch and its own modules again: about 150 MB of heap per process that no other shares
(torch's operator registry, Python's module objects), and seconds of start-up each. A *fork
server* imports them once (`PRELOAD`), then forks every service from itself. A forked service
shares those pages with the server and the other services until it writes one, so the cluster's
proportional memory (PSS) drops by about that much per service, and a service (or a restart of
one) starts without importing anything.

The server is its own ``python -m pdserve.launcher.forkserver`` process, started by the launcher
before any service, so it forks from a clean interpreter (no threads of the launcher's, no
event loop, no gRPC channel). The two speak over a Unix socket of packets:

* server -> launcher: ``{"ready": pid}`` once every module is imported (``{"error": ...}`` and
  exit if one fails);
* launcher -> server: ``{"module", "args", "env"}`` with two file descriptors, the service's
  stdout and stderr; server -> launcher: ``{"spawned": pid}`` or ``{"error": ...}``;
* server -> launcher: ``{"exited": pid, "returncode": code}`` when a service ends (its parent,
  the server, reaps it);
* launcher -> server: ``{"settle": true}`` once every service is up (no reply): the server
  hands back the pages of files only it still maps (`page_out_own_file_pages`).

The forked service starts a session of its own (as ``start_new_session``), takes the given
environment, stdout and stderr, and runs its module as ``python -m`` would (`runpy`, atexit
handlers and all). Its command line stays the server's; its name (``/proc/<pid>/comm``, what
``top`` and ``pgrep`` show) is the module's, e.g. ``pdserve-decode``. Python's `random`
reseeds itself in a forked child; numpy's global generator is reseeded here.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import queue
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import structlog

from pdserve.common.stale_files import is_process_running

log = structlog.get_logger(__name__)

PRELOAD = (
    "torch",
    "pdserve.engine.runner",
    "pdserve.prefill.server",
    "pdserve.decode.server",
    "pdserve.gateway.server",
)
"""What the server imports before it forks: torch, the engine and each service's server."""
MAX_MESSAGE = 1 << 20
"""The largest packet either side sends (a service's environment and flags)."""
READY_TIMEOUT_S = 120.0
"""How long the server may take to import `PRELOAD`."""
SPAWN_TIMEOUT_S = 30.0
PR_SET_NAME = 15
MADV_PAGEOUT = 21


class ForkServerError(RuntimeError):
    """The fork server did not start, or could not fork a service."""


class ForkedProcess:
    """A service forked by the `ForkServer`: the part of `subprocess.Popen` that
    `pdserve.launcher.child.ChildProcess` uses. Its exit comes from the server (its parent)."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stderr: IO[str] | None = None
        self._server = server
        self._ended = threading.Event()

    def _set_returncode(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        if self.returncode is None and self._server.is_lost and not is_process_running(self.pid):
            # NOTE: without the server no exit status comes; a gone process ended unknown.
            self._set_returncode(-signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            remaining = 0.2 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self._ended.wait(min(0.2, remaining))
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Starts the fork server (``python -m pdserve.launcher.forkserver``) and waits until it
    imported `preload`.

    Args:
        log_path: Where the server's own output goes.
        env: The server's environment (each service gets its own with `spawn`).
        preload: The modules it imports before forking.

    Raises:
        ForkServerError: If it exits or does not get ready within `READY_TIMEOUT_S`.
    """

    def __init__(
        self,
        log_path: Path,
        env: dict[str, str] | None = None,
        preload: Sequence[str] = PRELOAD,
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.is_lost = False
        self._socket = ours
        self._processes: dict[int, ForkedProcess] = {}
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._spawn_lock = threading.Lock()
        self._num_requests = 0
        self._abandoned: set[int] = set()  # NOTE: requests whose caller stopped waiting
        # NOTE: held while a reply is sorted (abandoned or queued) and while a request is
        # abandoned, so that a reply read just before its request was abandoned is not left
        # queued until the next spawn.
        self._sorting = threading.Lock()
        self.stopped_late: list[int] = []
        """Services forked after their caller gave up waiting (and started them itself),
        killed as soon as their pid came."""
        with log_path.open("a") as log, theirs:
            argv = [sys.executable, "-m", __name__, str(theirs.fileno()), *preload]
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self._reader.start()
        try:
            ready = self._replies.get(timeout=READY_TIMEOUT_S)
        except queue.Empty:
            self.close()
            raise ForkServerError(f"not ready within {READY_TIMEOUT_S:.0f} s") from None
        if "ready" not in ready:
            self.close()
            raise ForkServerError(str(ready.get("error", "it exited while importing")))

    def _read(self) -> None:
        while True:
            try:
                packet = self._socket.recv(MAX_MESSAGE)
            except OSError:
                packet = b""
            if not packet:
                self.is_lost = True
                self._replies.put({"error": "the fork server exited"})
                return
            message = json.loads(packet)
            if "exited" in message:
                process = self._processes.pop(message["exited"], None)
                if process is not None:
                    process._set_returncode(message["returncode"])
                continue
            with self._sorting:
                if message.get("request") in self._abandoned:
                    self._stop_late(message)
                    continue
                if "spawned" in message:
                    # NOTE: registered here, before its exit can be read.
                    message["process"] = ForkedProcess(message["spawned"], self)
                    self._processes[message["spawned"]] = message["process"]
                self._replies.put(message)

    def _stop_late(self, reply: dict[str, Any]) -> None:
        """Kills the service a reply to an abandoned request names (its caller started it
        otherwise)."""
        if "spawned" not in reply:
            return
        self._processes.pop(reply["spawned"], None)
        with contextlib.suppress(ProcessLookupError):
            os.kill(reply["spawned"], signal.SIGKILL)
        self.stopped_late.append(reply["spawned"])
        log.warning("fork_server_late_service_stopped", pid=reply["spawned"])

    def _abandon(self, number: int) -> None:
        """Marks request `number` abandoned (its caller stopped waiting), and stops what a
        reply to it already queued names; the other replies stay queued, in order."""
        with self._sorting:
            self._abandoned.add(number)
            with self._replies.mutex:
                late = [r for r in self._replies.queue if r.get("request") == number]
                for reply in late:
                    self._replies.queue.remove(reply)
            for reply in late:
                self._stop_late(reply)

    def spawn(
        self, module: str, args: Sequence[str], env: dict[str, str], stdout: int, stderr: int
    ) -> ForkedProcess:
        """Forks a service that runs `module` as ``python -m`` with `args`, `env`, and the file
        descriptors `stdout` and `stderr` (the caller keeps its own copies).

        Raises:
            ForkServerError: If the server is gone or could not fork.
        """
        with self._spawn_lock:
            if self.is_lost:
                raise ForkServerError("the fork server exited")
            self._num_requests += 1
            number = self._num_requests
            request = {"request": number, "module": module, "args": list(args), "env": env}
            try:
                socket.send_fds(self._socket, [json.dumps(request).encode()], [stdout, stderr])
                reply = self._replies.get(timeout=SPAWN_TIMEOUT_S)
                while reply.get("request", number) != number:
                    # NOTE: an abandoned request's reply queued before it was marked so.
                    self._stop_late(reply)
                    reply = self._replies.get(timeout=SPAWN_TIMEOUT_S)
            except (OSError, queue.Empty) as error:
                self._abandon(number)
                raise ForkServerError(f"could not fork {module}: {error!r}") from None
        if "process" not in reply:
            raise ForkServerError(f"could not fork {module}: {reply.get('error')}")
        process: ForkedProcess = reply["process"]
        return process

    def settle(self) -> None:
        """Tells the server every service is up: it hands back the pages of files only it
        maps (`page_out_own_file_pages`). Nothing where it is gone."""
        with self._spawn_lock, contextlib.suppress(OSError):
            self._socket.send(json.dumps({"settle": True}).encode())

    def close(self) -> None:
        """Stops the server (the services it forked keep running)."""
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(timeout=2)
        self._socket.close()


# ---- the server's side ------------------------------------------------------------------------


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # NOTE: the launcher is gone: nothing to tell
        sock.send(json.dumps(message).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


def serve(sock: socket.socket, preload: Sequence[str]) -> tuple[dict[str, Any], list[int]] | None:
    """Imports `preload`, then forks a service for each request until the launcher closes the
    socket (returns None). In a forked service it returns the request and its descriptors."""
    try:
        for name in preload:
            importlib.import_module(name)
    except Exception as error:  # NOTE: told to the launcher, which starts services itself
        _send(sock, {"error": f"importing {name}: {error!r}"})
        return None
    # NOTE: what the imports allocated is shared with every service: no collection of ours (or
    # of theirs, on these objects) writes to those pages.
    gc.collect()
    gc.freeze()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    _send(sock, {"ready": os.getpid()})
    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_read:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                _reap(sock)
                continue
            try:
                packet, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            except OSError:
                packet, fds = b"", []
            if not packet:
                return None
            request = json.loads(packet)
            if request.get("settle"):
                page_out_own_file_pages()
                continue
            try:
                pid = os.fork()
            except OSError as error:  # NOTE: no memory or process slot: the launcher starts it
                for fd in fds:
                    os.close(fd)
                _send(sock, {"error": repr(error), "request": request.get("request")})
                continue
            if pid == 0:
                selector.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_read, wake_write):
                    os.close(fd)
                return request, fds
            for fd in fds:
                os.close(fd)
            _send(sock, {"spawned": pid, "request": request.get("request")})


def page_out_own_file_pages() -> int:
    """Reclaims the pages of this process's file mappings that no other process maps
    (``madvise(MADV_PAGEOUT)``, Linux 5.4 and later; pages a service also maps stay); returns
    the bytes of memory (PSS) it gave back, and logs them.

    NOTE: importing torch runs code (its operators' registration) that only the server ever
    ran, so about 50 MB of library pages were resident in the server alone on the default
    model; a later fork maps what it touches from the file again.
    """
    before = _pss_bytes()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    failed = 0
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    for fields in regions:
        path = fields[5] if len(fields) > 5 else ""
        if not path.startswith("/") or path.startswith("/dev/"):
            continue
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if libc.madvise(low, high - low, MADV_PAGEOUT) != 0:
            failed += 1
    freed = max(0, before - _pss_bytes())
    log.info("fork_server_settled", freed_bytes=freed, failed_regions=failed)
    return freed


def _pss_bytes() -> int:
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/self/smaps_rollup") as rollup:
            line = next(line for line in rollup if line.startswith("Pss:"))
        return int(line.split()[1]) * 1024
    return 0


def run_service(request: dict[str, Any], fds: list[int]) -> None:
    """Becomes the service `request` asks for: a session of its own, its environment, stdout
    and stderr, then its module run as ``python -m`` runs it."""
    os.setsid()
    stdout, stderr = fds
    devnull = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((devnull, 0), (stdout, 1), (stderr, 2)):
        os.dup2(source, target)
        os.close(source)
    os.environ.clear()
    os.environ.update(request["env"])
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    sys.argv = [request["module"], *request["args"]]
    name_process(request["module"].replace(".", "-"))
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def name_process(name: str) -> None:
    """Names this process `name` (its first 15 bytes) where ``top``, ``ps -o comm`` and
    ``pgrep`` look: a forked service's command line is still the fork server's."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def main(argv: Sequence[str]) -> int:
    sock = socket.socket(fileno=int(argv[0]))
    served = serve(sock, argv[1:])
    if served is None:
        return 0
    sock.close()
    run_service(*served)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
