"""Keeps the services of `pdserve up` running: a gateway, prefill or decode that exits is
started again, after a wait that doubles with each restart in a row, until its restarts run
out; then `pdserve up` stops the cluster.

Every exit is unexpected here (the launcher stops its services only when it stops), whatever
its status: a service stopped by hand with SIGTERM is restarted too. The others serve on while
one is down or restarting. `RestartPolicy.decide` is the rule as a value; `Supervisor` applies
it to a `Cluster` each time it is polled and logs what died and what it did:
``service_exited`` (service, pid, exit_code or signal), ``service_restarted`` (the new pid,
after how long) and ``service_restarts_exhausted``.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from pdserve.common.logging import get_logger
from pdserve.launcher.child import ChildProcess

log = get_logger(__name__)

MAX_BACKOFF_S = 30.0
"""The longest wait before a restart, however many came before in a row."""

STABLE_AFTER_S = 60.0
"""A service that ran this long before it exited is restarted as if for the first time."""

PORT_WAIT_S = 30.0
"""How long a restart waits for the ports its service must bind again to be free (a
gateway's: clients and instances know it by them) before it starts it anyway."""


class RestartDecision(NamedTuple):
    """What to do about a service that exited.

    Attributes:
        is_restart: Start it again (else its restarts ran out).
        delay_s: How long to wait before starting it.
        num_restarts: Its restarts in a row, this one included (those before it, when none
            is left).
    """

    is_restart: bool
    delay_s: float
    num_restarts: int


@dataclass(frozen=True)
class RestartPolicy:
    """When a service that exited is started again.

    Args:
        max_restarts: Restarts in a row a service gets; 0: none (an exit stops the cluster).
        backoff_s: The wait before the first restart in a row; each next one waits twice as
            long, up to `max_backoff_s`.
        max_backoff_s: The longest wait.
        stable_after_s: A service that ran this long has its restarts in a row reset to 0.
    """

    max_restarts: int
    backoff_s: float
    max_backoff_s: float = MAX_BACKOFF_S
    stable_after_s: float = STABLE_AFTER_S

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, got {self.max_restarts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("restart backoff must be 0 or more seconds")

    def decide(self, num_restarts: int, uptime_s: float) -> RestartDecision:
        """What to do about a service that exited after running `uptime_s`, having been
        restarted `num_restarts` times in a row before."""
        if uptime_s >= self.stable_after_s:
            num_restarts = 0
        if num_restarts >= self.max_restarts:
            return RestartDecision(False, 0.0, num_restarts)
        delay_s = min(self.backoff_s * 2**num_restarts, self.max_backoff_s)
        return RestartDecision(True, delay_s, num_restarts + 1)


def exit_fields(returncode: int) -> dict[str, Any]:
    """How a process ended, as log fields: ``exit_code=N``, or ``signal=SIGKILL`` for one
    that a signal ended (Popen's negative status)."""
    if returncode >= 0:
        return {"exit_code": returncode}
    try:
        return {"signal": signal.Signals(-returncode).name}
    except ValueError:
        return {"signal": -returncode}


class SupervisedCluster(Protocol):
    """What `Supervisor` needs of a `Cluster`."""

    @property
    def children(self) -> list[ChildProcess]: ...

    def restart(self, child: ChildProcess) -> ChildProcess: ...

    def busy_ports(self, child: ChildProcess) -> list[int]:
        """The ports `child`'s restart must bind again that another socket holds now."""
        ...


class _Pending(NamedTuple):
    restart_at: float
    delay_s: float
    is_port_logged: bool = False


class Supervisor:
    """Restarts a cluster's services that exit, as `policy` says.

    Args:
        cluster: The processes (their list is updated by `cluster.restart`).
        policy: When to restart.
        clock: Monotonic seconds (the children's ``started_at`` are on the same clock).
    """

    def __init__(
        self,
        cluster: SupervisedCluster,
        policy: RestartPolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self._clock = clock
        self._num_restarts: dict[str, int] = {}
        self._pending: dict[str, _Pending] = {}

    @property
    def num_restarts(self) -> dict[str, int]:
        """Each service's restarts in a row so far, by name."""
        return dict(self._num_restarts)

    def poll(self) -> ChildProcess | None:
        """Notes the services that exited since the last poll and restarts those whose wait
        is over.

        Returns:
            A service whose restarts ran out (the cluster should stop), or None.
        """
        now = self._clock()
        for child in list(self.cluster.children):
            returncode = child.returncode
            if returncode is None:
                continue
            pending = self._pending.get(child.name)
            if pending is None:
                decision = self.policy.decide(
                    self._num_restarts.get(child.name, 0), now - child.started_at
                )
                log.warning(
                    "service_exited",
                    service=child.name,
                    pid=child.pid,
                    uptime_s=round(now - child.started_at, 1),
                    **exit_fields(returncode),
                )
                if not decision.is_restart:
                    log.error(
                        "service_restarts_exhausted",
                        service=child.name,
                        num_restarts=decision.num_restarts,
                        max_restarts=self.policy.max_restarts,
                    )
                    return child
                self._num_restarts[child.name] = decision.num_restarts
                pending = _Pending(now + decision.delay_s, decision.delay_s)
                self._pending[child.name] = pending
            if now >= pending.restart_at:
                # NOTE: on a busy host another process may hold one of a gateway's ports for a
                # while (an outgoing connection's ephemeral port): its restart waits for them,
                # since one that cannot bind exits and spends a restart.
                busy = self.cluster.busy_ports(child)
                waited_s = now - pending.restart_at
                if busy and waited_s < PORT_WAIT_S:
                    if not pending.is_port_logged:
                        log.warning("service_ports_busy", service=child.name, ports=busy)
                        self._pending[child.name] = pending._replace(is_port_logged=True)
                    continue
                del self._pending[child.name]
                restarted = self.cluster.restart(child)
                log.info(
                    "service_restarted",
                    service=child.name,
                    pid=restarted.pid,
                    previous_pid=child.pid,
                    after_s=pending.delay_s,
                    num_restarts=self._num_restarts[child.name],
                    max_restarts=self.policy.max_restarts,
                )
        return None
