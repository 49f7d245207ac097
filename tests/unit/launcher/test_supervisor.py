"""The restart rule of `pdserve up` as a table, and the supervisor applying it to a cluster of
stand-in processes on a fake clock (no process is started)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

import pytest
import structlog

from pdserve.common.config import from_args
from pdserve.launcher.__main__ import parse_args
from pdserve.launcher.config import ClusterConfig
from pdserve.launcher.supervisor import (
    PORT_WAIT_S,
    RestartDecision,
    RestartPolicy,
    Supervisor,
    exit_fields,
)


@pytest.mark.parametrize(
    ("max_restarts", "num_restarts", "uptime_s", "expected"),
    [
        (3, 0, 1.0, RestartDecision(True, 1.0, 1)),
        (3, 1, 1.0, RestartDecision(True, 2.0, 2)),
        (3, 2, 1.0, RestartDecision(True, 4.0, 3)),
        (3, 3, 1.0, RestartDecision(False, 0.0, 3)),  # run out
        (3, 3, 60.0, RestartDecision(True, 1.0, 1)),  # it had run long enough: counts again
        (9, 6, 1.0, RestartDecision(True, 30.0, 7)),  # 64 s, capped
        (0, 0, 1.0, RestartDecision(False, 0.0, 0)),  # no restarts: an exit stops the cluster
    ],
)
def test_restarts_back_off_and_run_out(
    max_restarts: int, num_restarts: int, uptime_s: float, expected: RestartDecision
) -> None:
    policy = RestartPolicy(max_restarts=max_restarts, backoff_s=1.0)
    assert policy.decide(num_restarts, uptime_s) == expected


def test_a_negative_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1, backoff_s=1.0)
    with pytest.raises(ValueError, match="backoff"):
        RestartPolicy(max_restarts=1, backoff_s=-1.0)


def test_exit_fields_name_the_signal() -> None:
    assert exit_fields(3) == {"exit_code": 3}
    assert exit_fields(0) == {"exit_code": 0}
    assert exit_fields(-signal.SIGKILL) == {"signal": "SIGKILL"}


@dataclass
class FakeChild:
    name: str
    pid: int
    started_at: float
    returncode: int | None = None


@dataclass
class FakeCluster:
    gateways: list[FakeChild]
    decodes: list[FakeChild]
    next_pid: int = 100
    restarted: list[str] = field(default_factory=list)
    clock: list[float] = field(default_factory=lambda: [0.0])

    @property
    def children(self) -> list[Any]:
        return [*self.gateways, *self.decodes]

    busy: dict[str, list[int]] = field(default_factory=dict)

    def busy_ports(self, child: Any) -> list[int]:
        return self.busy.get(child.name, [])

    def restart(self, child: Any) -> Any:
        self.next_pid += 1
        restarted = FakeChild(child.name, self.next_pid, self.clock[0])
        for members in (self.gateways, self.decodes):
            if child in members:
                members[members.index(child)] = restarted
        self.restarted.append(child.name)
        return restarted


def _events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [record for record in logs if record["event"] == name]


def test_a_dead_service_is_restarted_after_its_wait_and_the_others_are_left_alone() -> None:
    cluster = FakeCluster([FakeChild("gateway", 1, 0.0), FakeChild("gateway-1", 2, 0.0)],
                          [FakeChild("decode-0", 3, 0.0)])  # fmt: skip
    supervisor = Supervisor(cluster, RestartPolicy(max_restarts=2, backoff_s=1.0),
                            clock=lambda: cluster.clock[0])  # fmt: skip
    with structlog.testing.capture_logs() as logs:
        assert supervisor.poll() is None
        assert not logs and not cluster.restarted
        cluster.clock[0] = 5.0
        cluster.gateways[0].returncode = -signal.SIGKILL
        assert supervisor.poll() is None
        assert not cluster.restarted, "restarted before its wait was over"
        cluster.clock[0] = 5.5
        assert supervisor.poll() is None
        assert not cluster.restarted
        cluster.clock[0] = 6.0
        assert supervisor.poll() is None
    assert cluster.restarted == ["gateway"]
    assert [c.pid for c in cluster.children] == [101, 2, 3]
    (exited,) = _events(logs, "service_exited")
    assert exited["uptime_s"] == 5.0
    assert (exited["service"], exited["pid"], exited["signal"]) == ("gateway", 1, "SIGKILL")
    (restarted,) = _events(logs, "service_restarted")
    assert restarted["service"] == "gateway"
    assert (restarted["pid"], restarted["previous_pid"]) == (101, 1)
    assert (restarted["after_s"], restarted["num_restarts"]) == (1.0, 1)

    # NOTE: dies again at once: twice the wait; then the restarts run out.
    cluster.gateways[0].returncode = 1
    with structlog.testing.capture_logs() as logs:
        supervisor.poll()
        cluster.clock[0] = 7.9
        supervisor.poll()
        assert cluster.restarted == ["gateway"]
        cluster.clock[0] = 8.0
        supervisor.poll()
    assert cluster.restarted == ["gateway", "gateway"]
    assert _events(logs, "service_exited")[0]["exit_code"] == 1
    assert _events(logs, "service_restarted")[0]["after_s"] == 2.0
    cluster.gateways[0].returncode = 1
    with structlog.testing.capture_logs() as logs:
        exhausted = supervisor.poll()
    assert exhausted is cluster.gateways[0]
    (gave_up,) = _events(logs, "service_restarts_exhausted")
    assert (gave_up["service"], gave_up["num_restarts"], gave_up["max_restarts"]) == (
        "gateway", 2, 2
    )  # fmt: skip
    assert supervisor.num_restarts == {"gateway": 2}


def test_a_restart_waits_for_the_ports_its_service_binds_again() -> None:
    cluster = FakeCluster([FakeChild("gateway", 1, 0.0)], [], busy={"gateway": [8000]})
    supervisor = Supervisor(cluster, RestartPolicy(max_restarts=1, backoff_s=1.0),
                            clock=lambda: cluster.clock[0])  # fmt: skip
    cluster.gateways[0].returncode = -signal.SIGKILL
    with structlog.testing.capture_logs() as logs:
        supervisor.poll()
        cluster.clock[0] = 2.0
        supervisor.poll()
        cluster.clock[0] = 3.0
        supervisor.poll()
        assert not cluster.restarted, "started while another socket held its port"
        cluster.busy = {}
        supervisor.poll()
    assert cluster.restarted == ["gateway"]
    (busy,) = _events(logs, "service_ports_busy")  # once, not per poll
    assert busy["ports"] == [8000]


def test_a_port_that_stays_taken_is_waited_for_at_most_port_wait_s() -> None:
    cluster = FakeCluster([FakeChild("gateway", 1, 0.0)], [], busy={"gateway": [8000]})
    supervisor = Supervisor(cluster, RestartPolicy(max_restarts=1, backoff_s=1.0),
                            clock=lambda: cluster.clock[0])  # fmt: skip
    cluster.gateways[0].returncode = 1
    supervisor.poll()
    cluster.clock[0] = 1.0 + PORT_WAIT_S - 0.1
    supervisor.poll()
    assert not cluster.restarted
    cluster.clock[0] = 1.0 + PORT_WAIT_S
    supervisor.poll()  # NOTE: a gateway that cannot bind then exits, as before
    assert cluster.restarted == ["gateway"]


def test_a_free_port_is_told_from_a_taken_one() -> None:
    import socket

    from pdserve.launcher.cluster import _is_free

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not _is_free("127.0.0.1", port)
    assert _is_free("127.0.0.1", port)


def test_the_flags_reach_the_config_and_negative_values_are_refused() -> None:
    args = parse_args(["up", "--max-restarts", "0", "--restart-backoff-s", "0.5"])
    config = from_args(ClusterConfig, args)
    assert (config.max_restarts, config.restart_backoff_s) == (0, 0.5)
    assert ClusterConfig().max_restarts == 5
    with pytest.raises(ValueError, match="max_restarts"):
        ClusterConfig(max_restarts=-1)
    with pytest.raises(ValueError, match="restart_backoff_s"):
        ClusterConfig(restart_backoff_s=-0.1)
