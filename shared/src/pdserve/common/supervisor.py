"""A service started by a pdserve supervisor (`pdserve up`'s launcher, a test's cluster) stops
when that supervisor is gone.

The supervisor names itself in the service's environment (`SUPERVISOR_PID_ENV`, set by
`pdserve.launcher.child.ChildProcess`). A service runs in a session of its own (Ctrl-C in the
terminal reaches only the supervisor, which drains it), so a supervisor killed outright
(``kill -9``, the OOM killer) used to leave its services running with nobody to read their logs
or stop them: ports, shared-memory segments and memory held until someone found them. With
`watch_supervisor`, the service's event loop learns of the exit from a pidfd (no polling) and
drains and stops as on SIGTERM. A service started any other way (a container, systemd, a shell)
has no such variable and is not affected.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

SUPERVISOR_PID_ENV = "PDSERVE_SUPERVISOR_PID"
"""The pid of the process that supervises this service (unset: none)."""


def supervised_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) naming this process as the supervisor of
    the service it is given to."""
    return {**(os.environ if env is None else env), SUPERVISOR_PID_ENV: str(os.getpid())}


def watch_supervisor(
    loop: asyncio.AbstractEventLoop, on_gone: Callable[[], None]
) -> Callable[[], None]:
    """Calls `on_gone` on `loop` once the supervisor named in `SUPERVISOR_PID_ENV` has exited
    (at once if it is gone already); returns what stops the watch. Nothing is watched where
    the variable is unset or there is no pidfd (Linux before 5.3, another system)."""
    value = os.environ.get(SUPERVISOR_PID_ENV, "")
    pidfd_open = getattr(os, "pidfd_open", None)  # NOTE: Linux only
    if not value.isdigit() or pidfd_open is None:
        return _nothing
    pid = int(value)
    try:
        fd = pidfd_open(pid)
    except ProcessLookupError:
        log.warning("supervisor_gone", supervisor_pid=pid, detail="gone before this started")
        loop.call_soon(on_gone)
        return _nothing
    except (OSError, OverflowError) as error:  # NOTE: no pidfd here, or no such pid at all
        log.info("supervisor_not_watched", supervisor_pid=pid, detail=str(error))
        return _nothing

    is_open = True

    def gone() -> None:
        stop()
        log.warning("supervisor_gone", supervisor_pid=pid, detail="stopping as on SIGTERM")
        on_gone()

    def stop() -> None:
        nonlocal is_open
        if is_open:  # NOTE: once: a second close could close a descriptor reused meanwhile
            is_open = False
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                loop.remove_reader(fd)
            os.close(fd)

    loop.add_reader(fd, gone)
    return stop


def _nothing() -> None:
    pass
