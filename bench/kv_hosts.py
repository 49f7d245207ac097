"""NIXL between two hosts vs raw TCP between them: network namespaces on this machine.

    sudo .venv/bin/python bench/kv_hosts.py                      # 64 MiB, 5 repeats
    sudo .venv/bin/python bench/kv_hosts.py --size-mib 256 --repeats 3 --json

Two test hosts (network namespaces joined by a bridge, as `tests/support/netns.py` makes
them; needs root and iproute2). On the receiving host one process holds a buffer of the size
registered with a NIXL agent (UCX backend, progressed on a thread with a decode's pause while a
transfer is open) and a raw TCP receiver that reads into a buffer of the same size with
`recv_into` and acknowledges the last byte. On the sending host a process, alternating:

* ``raw_tcp``: `sendall` of the buffer in 1 MiB writes, until the acknowledgement;
* ``nixl``: one NIXL WRITE of the buffer from its registered memory into the receiver's, in
  1 MiB descriptors (a prefill's pieces), polled until complete.

Both ends limit UCX to TCP on their host's interface (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=eth0``):
on one machine UCX would otherwise copy through the kernel, which is not a network. What this
measures is the transport alone (no checksums, no SyncCache stream): `bench/kv_transfer.py`
measures the whole path on one host. Reported: MiB/s (median over repeats) and the ratio
nixl / raw TCP. Results go to bench/results/kv_hosts-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

MIB = 1 << 20
PIECE_BYTES = MIB
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"}


def receiver(size: int) -> None:
    """The receiving host: prints its NIXL agent, buffer address and TCP port as one JSON line,
    then serves both until stdin closes."""
    import numpy as np
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    from pdserve.kv.transports.nixl import PROGRESS_PAUSE_S

    agent = nixl_agent("receiver", nixl_agent_config(enable_prog_thread=False))
    buffer = np.zeros(size, dtype=np.uint8)
    agent.register_memory([(buffer.ctypes.data, size, 0, "")], "DRAM")
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("0.0.0.0", 0))
    server.listen(1)
    target = memoryview(bytearray(size))

    def serve_tcp() -> None:
        while True:
            conn, _ = server.accept()
            received = 0
            while received < size:
                received += conn.recv_into(target[received:])
            conn.sendall(b"k")
            conn.close()

    stop = threading.Event()

    def progress() -> None:
        while not stop.is_set():
            agent.get_new_notifs()
            time.sleep(PROGRESS_PAUSE_S)  # NOTE: as a decode's

    threading.Thread(target=serve_tcp, daemon=True).start()
    progressing = threading.Thread(target=progress)
    progressing.start()
    info = {
        "metadata": agent.get_agent_metadata().hex(),
        "address": buffer.ctypes.data,
        "port": server.getsockname()[1],
    }
    print(json.dumps(info), flush=True)
    sys.stdin.read()
    # NOTE: the agent's progress ends before the interpreter does: a NIXL call still running
    # while the agent is torn down at exit aborts the process ("terminate called ...").
    stop.set()
    progressing.join()


def sender(size: int, repeats: int, host: str, info: dict[str, Any]) -> None:
    """The sending host: alternates raw TCP and NIXL; prints the seconds of each as JSON."""
    import numpy as np
    from nixl_cu12._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("sender", nixl_agent_config(enable_prog_thread=False))
    source = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    agent.register_memory([(source.ctypes.data, size, 0, "")], "DRAM")
    name = agent.add_remote_agent(bytes.fromhex(info["metadata"]))
    count = size // PIECE_BYTES
    local = np.array(
        [[source.ctypes.data + i * PIECE_BYTES, PIECE_BYTES, 0] for i in range(count)],
        dtype=np.uint64,
    )
    remote = np.array(
        [[info["address"] + i * PIECE_BYTES, PIECE_BYTES, 0] for i in range(count)],
        dtype=np.uint64,
    )
    view = memoryview(source)

    def nixl_once() -> float:
        began = time.perf_counter()
        handle = agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), name
        )
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        took = time.perf_counter() - began
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"the NIXL WRITE ended {state}")
        return took

    def tcp_once() -> float:
        began = time.perf_counter()
        with socket.create_connection((host, info["port"])) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for offset in range(0, size, PIECE_BYTES):
                sock.sendall(view[offset : offset + PIECE_BYTES])
            if sock.recv(1) != b"k":
                raise RuntimeError("the TCP receiver did not acknowledge")
        return time.perf_counter() - began

    nixl_once()  # NOTE: the first WRITE connects
    tcp_once()
    seconds: dict[str, list[float]] = {"raw_tcp": [], "nixl": []}
    for repeat in range(repeats):
        ways = [("raw_tcp", tcp_once), ("nixl", nixl_once)]
        for way, once in ways[repeat % 2 :] + ways[: repeat % 2]:
            seconds[way].append(once())
    print(json.dumps(seconds), flush=True)


class Hosts:
    """Two network namespaces ("sender", "receiver") joined by a bridge (root only)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        subnet = f"10.{random.randint(64, 250)}.{random.randint(0, 255)}"
        self.bridge = f"pd{tag}br"
        self.namespaces = {"sender": f"pdbench-{tag}-s", "receiver": f"pdbench-{tag}-r"}
        self.addresses = {"sender": f"{subnet}.2", "receiver": f"{subnet}.3"}
        self._ip("link", "add", self.bridge, "type", "bridge")
        self._ip("link", "set", self.bridge, "up")
        for role, namespace in self.namespaces.items():
            link = f"pd{tag}{role[0]}"
            self._ip("netns", "add", namespace)
            self._ip(
                "link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", namespace
            )
            self._ip("link", "set", link, "master", self.bridge, "up")
            self._ip("-n", namespace, "link", "set", "lo", "up")
            self._ip("-n", namespace, "addr", "add", f"{self.addresses[role]}/24", "dev", "eth0")
            self._ip("-n", namespace, "link", "set", "eth0", "up")

    def command(self, role: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[role], *argv]

    def close(self) -> None:
        for namespace in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], capture_output=True, text=True, check=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, **UCX_ENV}
    me = [sys.executable, os.path.abspath(__file__), "--size-mib", str(args.size_mib)]
    hosts = Hosts()
    try:
        serving = subprocess.Popen(
            hosts.command("receiver", [*me, "--role", "receiver"]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert serving.stdout is not None and serving.stdin is not None
        info = next(line for line in serving.stdout if line.startswith("{"))
        sent = subprocess.run(
            hosts.command(
                "sender",
                [
                    *me,
                    "--role",
                    "sender",
                    "--repeats",
                    str(args.repeats),
                    "--receiver",
                    hosts.addresses["receiver"],
                    "--info",
                    info.strip(),
                ],
            ),
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        serving.stdin.close()
        serving.wait(10)
        seconds = json.loads(next(line for line in sent.stdout.splitlines() if line[:1] == "{"))
    finally:
        hosts.close()
    mib_s = {way: round(args.size_mib / statistics.median(s), 1) for way, s in seconds.items()}
    return {
        "command": " ".join(sys.argv[1:]),
        "size_mib": args.size_mib,
        "repeats": args.repeats,
        "seconds": seconds,
        "mib_per_s": mib_s,
        "ratio_nixl_over_raw_tcp": round(mib_s["nixl"] / mib_s["raw_tcp"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the results as JSON, last")
    parser.add_argument("--role", choices=("receiver", "sender"), help=argparse.SUPPRESS)
    parser.add_argument("--receiver", help=argparse.SUPPRESS)
    parser.add_argument("--info", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "receiver":
        receiver(args.size_mib * MIB)
        return
    if args.role == "sender":
        sender(args.size_mib * MIB, args.repeats, args.receiver, json.loads(args.info))
        return
    from common import write_results

    results = run(args)
    mib_s = results["mib_per_s"]
    print(
        f"{args.size_mib} MiB between two hosts: raw TCP {mib_s['raw_tcp']:.1f} MiB/s, "
        f"nixl {mib_s['nixl']:.1f} MiB/s ({results['ratio_nixl_over_raw_tcp']:.2f}x)"
    )
    print(f"results: {write_results('kv_hosts', results)}")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
