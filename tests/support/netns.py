"""Test hosts on one machine: a network namespace per host, joined by a bridge.

Each host has its own network stack and one address on a private /24; the test process (in
the machine's own namespace) holds the bridge's address, so it reaches every host the way a
client on the network would. A host is cut off by taking its link to the bridge down (packets
are dropped, nothing is refused, exactly what a partition looks like to TCP) and joined again
by taking it up. A host can also be cut off from some hosts only (`cut`: their packets are
dropped in its namespace, the others still reach it) or its link slowed (`slow`: a rate and a
delay, both ways); `restore` undoes all three.

Needs root and iproute2's ``ip`` (``tc`` to slow a link, ``iptables`` to cut some hosts off).
Nothing is shared between hosts but the file system: a process started on a host sees only
that host's interfaces.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import uuid
from collections.abc import Iterable
from dataclasses import dataclass


class NetnsUnavailable(RuntimeError):
    """The machine does not let this process make network namespaces (not root, no ``ip``)."""


@dataclass(frozen=True)
class Host:
    """One test host: its namespace, its address and its end of the link to the bridge."""

    name: str
    namespace: str
    address: str
    link: str  # the bridge's end of the veth pair (in the machine's namespace)

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this host (``ip netns exec`` execs it: the process keeps its pid)."""
        return ["ip", "netns", "exec", self.namespace, *argv]


class TestNetwork:
    """Hosts named `names`, each in a namespace of its own on one bridge; removed on close.

    Args:
        names: The hosts to make, e.g. ``["gateway", "prefill-0", "decode-0"]``.

    Raises:
        NetnsUnavailable: If namespaces, veth pairs or the bridge cannot be made.
    """

    __test__ = False  # NOTE: not a pytest test class despite its name

    def __init__(self, names: Iterable[str]) -> None:
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` is not installed")
        tag = uuid.uuid4().hex[:6]
        # NOTE: interface names have at most 15 characters; the subnet is picked at random so
        # two runs on one machine do not collide.
        self.bridge = f"pd{tag}br"
        subnet = f"10.{random.randint(64, 250)}.{random.randint(0, 255)}"
        self.address = f"{subnet}.1"
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        try:
            self._ip("link", "add", self.bridge, "type", "bridge")
            self._ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
            self._ip("link", "set", self.bridge, "up")
            for index, name in enumerate(names, start=2):
                self._add_host(name, f"pd{tag}-{index}", f"{subnet}.{index}")
        except BaseException:
            self.close()
            raise

    def _add_host(self, name: str, tag: str, address: str) -> None:
        namespace, link = f"pdserve-{tag}", f"{tag}h"
        self._ip("netns", "add", namespace)
        self._namespaces.append(namespace)
        self._ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        self._ip("link", "set", link, "master", self.bridge, "up")
        self._ip("-n", namespace, "link", "set", "lo", "up")
        self._ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        self._ip("-n", namespace, "link", "set", "eth0", "up")
        self.hosts[name] = Host(name, namespace, address, link)

    def partition(self, name: str) -> None:
        """Cuts host `name` off the network: its packets (and everyone's to it) are dropped."""
        self._ip("link", "set", self.hosts[name].link, "down")

    def heal(self, name: str) -> None:
        """Joins host `name` to the network again."""
        self._ip("link", "set", self.hosts[name].link, "up")

    def cut(self, name: str, peers: Iterable[str]) -> None:
        """Cuts host `name` off from the hosts `peers` only: packets between them are dropped
        on `name` (both ways), every other host and the machine's own address still reach it.
        Needs ``iptables`` (the filter of `name`'s namespace)."""
        namespace = self.hosts[name].namespace
        for peer in peers:
            address = self.hosts[peer].address
            for chain, side in (("INPUT", "-s"), ("OUTPUT", "-d")):
                self._run("ip", "netns", "exec", namespace, "iptables", "-w", "-A", chain,
                          side, address, "-j", "DROP")  # fmt: skip

    def slow(self, name: str, rate: str, delay_ms: int) -> str:
        """Slows host `name`'s link both ways to `rate` (``tc`` units, e.g. ``8mbit``), each
        packet `delay_ms` later (netem); where the kernel has no netem, a token bucket (tbf)
        gives the rate alone, and the delay is what queues ahead of a packet. Returns what was
        applied (``netem ...`` or ``tbf ...``)."""
        host = self.hosts[name]
        netem = ["root", "netem", "delay", f"{delay_ms}ms", "rate", rate]
        # NOTE: a bucket of 32 KiB; a packet queued longer than 2 s is dropped (TCP sends it
        # again), as on a congested link.
        tbf = ["root", "tbf", "rate", rate, "burst", "32kb", "latency", "2s"]
        for qdisc in (netem, tbf):
            if self._tc("qdisc", "add", "dev", host.link, *qdisc, check=False):
                self._tc("-n", host.namespace, "qdisc", "add", "dev", "eth0", *qdisc)
                return " ".join(qdisc[1:])
        raise NetnsUnavailable("neither netem nor tbf can slow a link on this kernel")

    def restore(self, name: str) -> None:
        """Host `name`'s link as it was made: up, nothing cut, nothing slowed."""
        host = self.hosts[name]
        for argv in (
            ["ip", "netns", "exec", host.namespace, "iptables", "-w", "-F"],
            ["tc", "qdisc", "del", "dev", host.link, "root"],
            ["tc", "-n", host.namespace, "qdisc", "del", "dev", "eth0", "root"],
        ):
            # NOTE: it fails where there is nothing to remove.
            subprocess.run(argv, capture_output=True, check=False)
        self.heal(name)

    def close(self) -> None:
        """Removes every namespace (with its end of the veth pair) and the bridge."""
        for namespace in self._namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self._namespaces.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    def __enter__(self) -> TestNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _tc(*args: str, check: bool = True) -> bool:
        """``tc`` with `args`; whether it did (raises when `check` and it did not)."""
        if shutil.which("tc") is None:
            raise NetnsUnavailable("iproute2's `tc` is not installed")
        done = subprocess.run(["tc", *args], capture_output=True, text=True, check=False)
        if done.returncode != 0 and check:
            raise NetnsUnavailable(f"tc {' '.join(args)}: {done.stderr.strip()}")
        return done.returncode == 0

    @staticmethod
    def _run(*argv: str) -> None:
        done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise NetnsUnavailable(f"{' '.join(argv)}: {done.stderr.strip()}")

    @staticmethod
    def _ip(*args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")
