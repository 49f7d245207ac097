"""The Helm chart's pods run as podman containers from the pdserve image.

Each container is started as the kubelet would start the rendered pod spec: the same image,
command, args (``$(POD_NAME)`` and ``$(POD_IP)`` expanded), environment, user and group, dropped
capabilities, no privilege escalation, memory limit, and the chart's volumes mounted at the
chart's paths (the CA Secret and the ``tls`` emptyDir are host directories). Containers share
the host's network (``--network=host``): each pod gets its own loopback address as its pod IP
(replica n of a Deployment: ``127.0.0.n``, so two replicas bind the same ports as pods do), and
the chart's ``0.0.0.0`` becomes that address. The probes are asked as the kubelet asks them.

`ensure_image` builds the image first unless it is up to date (``make test`` builds it before
pytest, through ``make image``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.chart import (
    container_ports,
    grpc_probe,
    http_probe,
)

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("IMAGE") or "pdserve:0.1.0"
TEST_LABEL = "org.pdserve.test"


def podman_binary() -> str:
    """The podman executable; the calling test fails (never skips) without one."""
    binary = shutil.which("podman")
    if binary is None:
        pytest.fail("podman is not installed: `make test` installs it (make system-deps)",
                    pytrace=False)  # fmt: skip
    return binary


def podman(
    *args: str, timeout_s: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([podman_binary(), *args], capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    if check:
        assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr}"
    return done


def ensure_image() -> str:
    """The image the tests run (``$IMAGE``, pdserve:0.1.0), built unless up to date."""
    podman_binary()
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "image.py")],
        capture_output=True, text=True, timeout=1800,
        env={**os.environ, "IMAGE": IMAGE, "CONTAINER_RUNTIME": "podman"},
    )  # fmt: skip
    assert done.returncode == 0, f"make image failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return IMAGE


def workload(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (found,) = [
        doc for doc in docs if doc["kind"] in ("Deployment", "StatefulSet")
        and doc["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]  # fmt: skip
    return found


def memory_flag(quantity: str) -> str:
    """A Kubernetes memory quantity (6Gi, 256Mi) as podman's --memory (bytes)."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6,
             "G": 10**9}  # fmt: skip
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", quantity)
    assert match, quantity
    return str(int(match.group(1)) * units.get(match.group(2), 1))


class ContainerPod:
    """One pod of a rendered Deployment: its init containers, then its main container, run by
    podman.

    Args:
        spec: The workload's pod template spec.
        name: The pod's name (its instance id).
        pod_ip: The pod's address (a loopback address).
        directory: Where its volumes and log go.
        ca_dir: The host directory that stands in for the CA Secret.
        session: A label value shared by every container of the test (removed at the end).
    """

    def __init__(
        self,
        spec: dict[str, Any],
        name: str,
        pod_ip: str,
        directory: Path,
        ca_dir: Path,
        session: str,
    ) -> None:
        self.spec = spec
        self.name = name
        self.pod_ip = pod_ip
        self.directory = directory
        self.ca_dir = ca_dir
        self.session = session
        self.tls_dir = directory / "tls"
        self.tls_dir.mkdir(parents=True)
        (self.main,) = spec["containers"]
        self.container_name = f"pdserve-test-{session}-{name}"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self._log = directory / "main.log"
        context = spec.get("securityContext", {})
        self.user = f"{context.get('runAsUser', 0)}:{context.get('runAsGroup', 0)}"
        for path in (self.tls_dir, directory):
            os.chown(path, int(context.get("runAsUser", 0)), int(context.get("fsGroup", 0)))

    def _env(self) -> dict[str, str]:
        return {"POD_NAME": self.name, "POD_IP": self.pod_ip}

    def argv(self, container: dict[str, Any]) -> list[str]:
        """The container's command and args as the kubelet expands them (``$(VAR)``), the
        chart's all-interfaces address as the pod's own."""
        env = self._env()
        argv = [*container["command"], *container.get("args", [])]
        argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], str(arg)) for arg in argv]
        return [self.pod_ip if arg == "0.0.0.0" else arg for arg in argv]

    def environment(self, container: dict[str, Any]) -> dict[str, str]:
        """The container's env: plain values, and the downward API's pod name and address."""
        fields = {"metadata.name": self.name, "status.podIP": self.pod_ip}
        env: dict[str, str] = {}
        for entry in container.get("env", []):
            if "value" in entry:
                env[entry["name"]] = str(entry["value"])
            else:
                env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        return env

    def podman_run(self, container: dict[str, Any], name: str) -> list[str]:
        """``podman run`` for one container of the pod, as the kubelet would run it."""
        volumes = {"ca": self.ca_dir, "tls": self.tls_dir}
        security = container.get("securityContext", {})
        args = [podman_binary(), "run", "--rm", "--name", name, "--network=host",
                "--label", f"{TEST_LABEL}={self.session}", "--user", self.user,
                "--sig-proxy=false"]  # fmt: skip
        for capability in security.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", capability.lower()]
        if security.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        limit = container.get("resources", {}).get("limits", {}).get("memory")
        if limit:
            args += ["--memory", memory_flag(limit)]
        for key, value in self.environment(container).items():
            args += ["--env", f"{key}={value}"]
        for mount in container.get("volumeMounts", []):
            mode = "ro" if mount.get("readOnly") else "rw"
            args += ["--volume", f"{volumes[mount['name']]}:{mount['mountPath']}:{mode}"]
        return [*args, container["image"], *self.argv(container)]

    def start(self) -> None:
        """The init containers one after the other, then the main container (not waited on)."""
        for init in self.spec.get("initContainers", []):
            command = self.podman_run(init, f"{self.container_name}-{init['name']}")
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{self.name} {init['name']}: {done.stderr}"
        log = self._log.open("wb")
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            self.podman_run(self.main, self.container_name), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()

    def log(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def events(self, name: str) -> list[dict[str, Any]]:
        """The JSON log records of this event name, so far."""
        records = []
        for line in self.log().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") == name:
                    records.append(record)
        return records

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def host_pid(self) -> int:
        """The pid of the container's main process, as the host sees it."""
        done = podman("inspect", "--format", "{{.State.Pid}}", self.container_name)
        return int(done.stdout.strip())

    def kill(self, signal_name: str) -> None:
        podman("kill", "--signal", signal_name, self.container_name)

    def wait(self, timeout_s: float) -> int:
        """The container's exit code once it exits (podman run's own exit status)."""
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self) -> int | None:
        """SIGTERM (a pod's deletion), then its exit code within the grace period; killed when
        it does not stop by then."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        podman("kill", "--signal", "TERM", self.container_name, check=False)
        try:
            return self.process.wait(self.spec.get("terminationGracePeriodSeconds", 30))
        except subprocess.TimeoutExpired:
            podman("kill", "--signal", "KILL", self.container_name, check=False)
            self.process.wait(30)
            return None


def remove_containers(session: str) -> None:
    """Every container this session started, removed (running or not)."""
    done = podman("ps", "-a", "-q", "--filter", f"label={TEST_LABEL}={session}", check=False)
    ids = done.stdout.split()
    if ids:
        podman("rm", "-f", "-t", "0", *ids, check=False, timeout_s=120)


def new_session() -> str:
    return uuid.uuid4().hex[:8]


def probe(pod: ContainerPod, kind: str) -> bool:
    """The pod's main container's `kind` probe (startupProbe, readinessProbe, livenessProbe)."""
    spec = pod.main[kind]
    if "grpc" in spec:
        return grpc_probe(spec, pod.pod_ip)
    return http_probe(spec, container_ports(pod.main), pod.pod_ip)


@contextlib.contextmanager
def session_containers() -> Iterator[str]:
    """A label for the block's containers; every one of them removed at its end."""
    session = new_session()
    try:
        yield session
    finally:
        remove_containers(session)
