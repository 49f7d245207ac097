"""A `ProcessCluster` over test hosts (`support.netns`): every process runs on the host named
like it ("gateway", "prefill-0", "decode-1", ...), bound to that host's address, and reaches
the others only over the network. A process started again (`restart`) runs on its host again.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from pdserve.launcher.child import ChildProcess
from pdserve.launcher.config import ClusterConfig
from support.netns import TestNetwork
from support.process_cluster import ProcessCluster


class MultiHostCluster(ProcessCluster):
    """A `ProcessCluster` whose every process runs on the test host named like it, bound to
    that host's address (the gateway's address is the cluster's ``host``)."""

    def __init__(self, config: ClusterConfig, network: TestNetwork) -> None:
        super().__init__(config)
        self.network = network

    def _start_fork_server(self) -> None:
        """None: a process runs in its host's network namespace, not forked from one."""

    def _spawn(self, name: str, module: str, args: list[str]) -> ChildProcess:
        is_restart = name in self._commands
        self._commands[name] = (module, args)
        host = self.network.hosts[name]
        args = [host.address if previous == "--host" else arg for previous, arg in pairs(args)]
        argv = [sys.executable, "-m", module, *args, *self._security_args(name)]
        argv += ["--log-level", self.config.log_level]
        log_path = self.log_dir / f"{name}.log"
        return ChildProcess(name, host.command(argv), log_path, self.env, is_append=is_restart)


def pairs(args: list[str]) -> Iterator[tuple[str, str]]:
    """Each argument with the one before it (``""`` for the first)."""
    return zip(["", *args[:-1]], args, strict=True)


@contextlib.contextmanager
def started_across(
    config: ClusterConfig, network: TestNetwork, stop_timeout_s: float = 10.0
) -> Iterator[MultiHostCluster]:
    """Starts a `MultiHostCluster`; on exit restores every host's link and stops it."""
    started = MultiHostCluster(config, network)
    started.start()
    try:
        yield started
    finally:
        for name in network.hosts:
            network.restore(name)
        started.stop(timeout_s=stop_timeout_s)
