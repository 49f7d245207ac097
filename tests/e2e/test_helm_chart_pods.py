"""The Helm chart's pods, run as local processes: what the chart renders is what runs.

With no container runtime at hand, this is the closest check that the chart works: helm renders
it (default values but ports), and each pod runs as the kubelet would run it, with
``$(POD_NAME)`` and ``$(POD_IP)`` expanded, its init container first (issuing the pod's
certificate from a CA directory that stands in for the Secret), then its main container, on
loopback ports: the chart's etcd first (its fixed ports and the Service name mapped to free
loopback ports), then prefill, decode and gateway. The probes the chart declares are asked as
the kubelet asks them (gRPC health on the health port, HTTP GETs on the gateway), and the
chart's ``helm test`` pod runs its request against the gateway. The default model comes from
the pdserve cache by name, as in the image.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.chart import (
    RELEASE,
    container_ports,
    grpc_probe,
    helm_template,
    http_probe,
    until,
)
from support.ports import free_port

from pdserve.common.env import ENV_CACHE_DIR, cache_dir
from pdserve.engine.model_store import ResolvedModel

BIN = Path(sys.executable).parent
POD_IP = "127.0.0.1"
START_TIMEOUT_S = 120.0
# The containers' paths, and where each pod's stand-in lives under the test's directory.
CA_MOUNT, TLS_MOUNT = "/ca", "/tls"


class Pod:
    """One pod of a rendered Deployment, its containers run as processes.

    Args:
        spec: The workload's pod template spec.
        name: The pod's name (its instance id).
        directory: Where its volumes and logs go.
        ca_dir: The CA directory that stands in for the CA Secret.
        renames: Substrings of arguments replaced (cluster names and fixed ports made local).
    """

    def __init__(
        self,
        spec: dict[str, Any],
        name: str,
        directory: Path,
        ca_dir: Path,
        renames: dict[str, str],
    ) -> None:
        self.spec = spec
        self.name = name
        self.directory = directory
        self.ca_dir = ca_dir
        self.renames = renames
        self.tls_dir = directory / "tls"
        self.process: subprocess.Popen[bytes] | None = None
        (self.main,) = spec["containers"]

    def argv(self, container: dict[str, Any]) -> list[str]:
        """The container's command and args as the kubelet expands them, its mounts mapped
        to this pod's directories and its bind address to loopback."""
        env = {"POD_NAME": self.name, "POD_IP": POD_IP}
        argv = [*container["command"], *container.get("args", [])]
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in argv]
        argv = [self._local(arg) for arg in argv]
        program = BIN / argv[0] if (BIN / argv[0]).exists() else shutil.which(argv[0])
        assert program is not None, f"{argv[0]} is not installed (make system-deps)"
        return [str(program), *argv[1:]]

    def _local(self, arg: str) -> str:
        for name, local in self.renames.items():
            arg = arg.replace(name, local)
        if arg == "0.0.0.0":
            return POD_IP
        if arg == CA_MOUNT:
            return str(self.ca_dir)
        if arg == TLS_MOUNT or arg.startswith(TLS_MOUNT + "/"):
            return str(self.tls_dir) + arg.removeprefix(TLS_MOUNT)
        return arg

    def start(self, env: dict[str, str]) -> None:
        for init in self.spec.get("initContainers", []):
            done = subprocess.run(self.argv(init), capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{self.name} {init['name']}: {done.stderr}"
        log = (self.directory / "main.log").open("wb")
        self.process = subprocess.Popen(
            self.argv(self.main), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )

    def log(self) -> str:
        return (self.directory / "main.log").read_text(errors="replace")

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def stop(self) -> int | None:
        """SIGTERM (as on a pod's deletion), then the exit code within the grace period."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(self.spec.get("terminationGracePeriodSeconds", 30))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None


def log_records(pod: Pod) -> list[dict[str, Any]]:
    records = []
    for line in pod.log().splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


@pytest.fixture
def pods(tmp_path: Path, smollm2: ResolvedModel) -> Iterator[tuple[list[Pod], list[dict]]]:
    """The rendered chart's pods started in order (etcd, prefill, decode, gateway), and the
    rendered objects."""
    ca_dir = tmp_path / "ca-secret"
    done = subprocess.run([str(BIN / "pdserve"), "certs", "init", "--dir", str(ca_dir)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    ports = ["gateway.restPort", "gateway.grpcPort", "gateway.internalPort", "prefill.port",
             "prefill.healthPort", "prefill.metricsPort", "decode.port", "decode.kvTcpPort",
             "decode.healthPort", "decode.metricsPort"]  # fmt: skip
    values = {key: str(free_port((POD_IP,))) for key in ports}
    values |= {"decode.replicas": "1", "prefill.numThreads": "1", "decode.numThreads": "1"}
    docs = helm_template(values)
    etcd_port, etcd_peer_port = free_port((POD_IP,)), free_port((POD_IP,))
    renames = {
        f"{RELEASE}-pdserve-etcd:2379": f"{POD_IP}:{etcd_port}",
        "0.0.0.0:2379": f"{POD_IP}:{etcd_port}",
        "127.0.0.1:2380": f"{POD_IP}:{etcd_peer_port}",
        "/var/lib/etcd": str(tmp_path / "etcd-data"),
    }
    started: list[Pod] = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [pod.stop() for pod in reversed(started)])
        for component in ("etcd", "prefill", "decode", "gateway"):
            (workload,) = [
                doc for doc in docs if doc["kind"] in ("Deployment", "StatefulSet")
                and doc["metadata"]["labels"]["app.kubernetes.io/component"] == component
            ]  # fmt: skip
            name = f"{workload['metadata']['name']}-0"
            (tmp_path / name).mkdir()
            spec = workload["spec"]["template"]["spec"]
            pod = Pod(spec, name, tmp_path / name, ca_dir, renames)
            pod.start({ENV_CACHE_DIR: str(cache_dir())})
            started.append(pod)
            if component == "etcd":
                ready = pod.main["readinessProbe"]
                until(lambda ready=ready: http_probe(ready, {"client": etcd_port}, POD_IP), 30,
                      "etcd readiness", started)  # fmt: skip
        yield started[1:], docs


def test_the_charts_pods_start_pass_their_probes_and_answer(pods) -> None:
    started, docs = pods
    prefill, decode, gateway = started
    for pod in (prefill, decode):
        until(lambda pod=pod: grpc_probe(pod.main["startupProbe"], POD_IP), START_TIMEOUT_S,
              f"{pod.name} startup probe", started)  # fmt: skip
        assert all(
            grpc_probe(pod.main[kind], POD_IP) for kind in ("readinessProbe", "livenessProbe")
        )
    ports = container_ports(gateway.main)
    until(lambda: http_probe(gateway.main["readinessProbe"], ports, POD_IP), 30,
          "gateway readiness (/health: a registered pair)", started)  # fmt: skip
    assert http_probe(gateway.main["livenessProbe"], ports, POD_IP)

    # Each instance runs under its pod's certificate: the instance id is the pod name.
    for pod, event in ((prefill, "prefill_started"), (decode, "decode_started")):
        (record,) = [line for line in log_records(pod) if line.get("event") == event]
        assert record["instance_id"] == pod.name
        assert record["internal_plane"] != "insecure"

    # The chart's `helm test` pod, its Service name pointed at the gateway's loopback port.
    (test_pod,) = [doc for doc in docs if doc["kind"] == "Pod"]
    (tester,) = test_pod["spec"]["containers"]
    script = tester["args"][0].replace(f"{RELEASE}-pdserve-gateway:", f"{POD_IP}:")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the first answer was empty"

    # Deleting the pods drains them: SIGTERM, a clean exit within the grace period.
    for pod in reversed(started):
        assert pod.stop() == 0, f"{pod.name} did not stop cleanly\n{pod.log()[-3000:]}"
