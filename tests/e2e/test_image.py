"""The pdserve image, run as the Helm chart runs it: gateway, prefill and two decodes as podman
containers of the one image.

The image is the one ``make image`` builds (``make test`` builds it before pytest; here it is
only checked to be up to date, and built if not). The chart is rendered by helm with its own
etcd turned off for a host etcd (``etcd.endpoint``: the chart's etcd image is not ours to
test), free ports, one torch thread per instance, and ``--deterministic`` on the prefill and
decodes (``extraArgs``), and every pod is started as `support.image_pods` describes: the
chart's commands, environment, probes, user, mounts and memory limits, its init containers
issuing each pod's certificate from a CA the image made, so the internal plane runs on mutual
TLS. Each pod's time from ``podman run`` to ready is recorded in pytest's cache
(``pdserve/image_ready_s``).

What is checked: every command, flag, port, probe and environment variable of the rendered
chart is one the image answers to; the pods pass their probes and serve on every port they
declare; a chat completion through the official ``openai`` SDK equals the same request to
``pdserve up`` on the host (greedy); a decode container killed mid-stream (SIGKILL) has its
streams migrated to the other, which finish with the tokens ``pdserve up`` gave; the chart's
``helm test`` pod answers; every container exits 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from support.chart import helm_template, until
from support.etcd_server import running_etcd
from support.image_pods import (
    IMAGE,
    ContainerPod,
    ensure_image,
    podman,
    probe,
    session_containers,
    workload,
)
from support.launcher_cli import running_launcher
from support.ports import free_port
from support.process_cluster import counter_at, set_when_streaming, stream_token_ids

from pdserve.engine.model_store import ResolvedModel

# NOTE: the module's first test starts everything; the default per-test bound is too short for
# a busy two-core machine starting four containers after `pdserve up`.
pytestmark = pytest.mark.timeout(900)

START_TIMEOUT_S = 240.0
INSTANCE_ARGS = "--deterministic --num-threads 1"
CHAT: dict[str, Any] = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 24,
    "temperature": 0.0,
}
STREAM_PROMPTS = [f"{i}. Tell me a long story about a lighthouse keeper." for i in range(4)]
STREAM_TOKENS = 120
# The other values the chart is rendered with for the agreement check (each its own render).
VALUE_SETS: list[dict[str, str]] = [
    {},
    {"tls.enabled": "false"},
    {"gateway.apiKeySecret": "keys", "otlpEndpoint": "http://collector:4317"},
    {"model.volume.emptyDir.sizeLimit": "1Gi", "model.pullOnStart": "true",
     "model.servedModelName": "m", "prefill.gpus": "1"},
]  # fmt: skip


@dataclass
class Reference:
    """What `pdserve up` on the host answered."""

    chat: str
    streams: list[list[int]]


async def _streams(
    base_url: str, model: str, on_tokens: list[Any] | None = None
) -> list[list[int]]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=180)
    async with client:
        return list(
            await asyncio.gather(
                *(
                    stream_token_ids(
                        client, model, prompt, max_tokens=STREAM_TOKENS, timeout_s=300,
                        on_tokens=None if on_tokens is None else on_tokens[i], temperature=0.0,
                        extra_body={"ignore_eos": True},
                    )
                    for i, prompt in enumerate(STREAM_PROMPTS)
                )
            )
        )  # fmt: skip


def chat(base_url: str, model: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=180)
    answer = client.chat.completions.create(model=model, **CHAT)
    assert answer.usage is not None and answer.usage.completion_tokens > 0
    return answer.choices[0].message.content or ""


@pytest.fixture(scope="module")
def image() -> str:
    return ensure_image()


@pytest.fixture(scope="module")
def reference(smollm2: ResolvedModel, tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The chat completion and the streams, asked of `pdserve up` on the host."""
    log_dir = tmp_path_factory.mktemp("pdserve-up")
    args = ["--port", "0", "--grpc-port", "0", "--internal-port", "0", "--log-dir", str(log_dir),
            "--prefill-args", INSTANCE_ARGS, "--decode-args", INSTANCE_ARGS]  # fmt: skip
    with running_launcher(args) as up:
        up.wait_for_banner(START_TIMEOUT_S)
        base_url = f"{up.rest_urls[0]}/v1"
        return Reference(
            chat(base_url, smollm2.name), asyncio.run(_streams(base_url, smollm2.name))
        )


@dataclass
class Pods:
    gateway: ContainerPod
    prefill: ContainerPod
    decodes: list[ContainerPod]
    docs: list[dict[str, Any]]
    ready_s: dict[str, float]
    model: str

    @property
    def all(self) -> list[ContainerPod]:
        return [self.prefill, *self.decodes, self.gateway]

    @property
    def rest_url(self) -> str:
        port = self.gateway.main["ports"][0]["containerPort"]
        return f"http://{self.gateway.pod_ip}:{port}"


def image_values() -> dict[str, str]:
    repository, tag = IMAGE.rsplit(":", 1)
    return {"image.repository": repository, "image.tag": tag}


@pytest.fixture(scope="module")
def pods(
    image: str,
    reference: Reference,
    smollm2: ResolvedModel,
    tmp_path_factory: pytest.TempPathFactory,
    pytestconfig: pytest.Config,
) -> Iterator[Pods]:
    """The chart's gateway, prefill and two decodes as containers, started together (as a
    cluster schedules them) and ready."""
    tmp = tmp_path_factory.mktemp("image-pods")
    hosts = ("127.0.0.1", "127.0.0.2")
    ports = ["gateway.restPort", "gateway.grpcPort", "gateway.internalPort", "prefill.port",
             "prefill.healthPort", "prefill.metricsPort", "decode.port", "decode.kvTcpPort",
             "decode.healthPort", "decode.metricsPort"]  # fmt: skip
    with running_etcd(tmp) as etcd, session_containers() as session:
        values = {key: str(free_port(hosts)) for key in ports} | image_values()
        values |= {"etcd.enabled": "false", "etcd.endpoint": f"127.0.0.1:{etcd.port}",
                   "decode.replicas": "2", "prefill.numThreads": "1", "decode.numThreads": "1",
                   "prefill.extraArgs": "{--deterministic}",
                   "decode.extraArgs": "{--deterministic}"}  # fmt: skip
        docs = helm_template(values)
        ca_dir = tmp / "ca-secret"
        ca_dir.mkdir()
        with contextlib.suppress(PermissionError):
            os.chown(ca_dir, 10001, 10001)
        # NOTE: the cluster CA, made by the image's own `pdserve certs init`.
        podman("run", "--rm", "--network=host", "--user", "10001:10001", "--volume",
               f"{ca_dir}:/ca:rw", image, "pdserve", "certs", "init", "--dir", "/ca")  # fmt: skip

        def pods_of(component: str) -> list[ContainerPod]:
            deployment = workload(docs, component)
            spec = deployment["spec"]["template"]["spec"]
            name = deployment["metadata"]["name"]
            return [
                ContainerPod(
                    spec, f"{name}-{n}", f"127.0.0.{n + 1}", tmp / f"{name}-{n}", ca_dir, session
                )
                for n in range(deployment["spec"]["replicas"])
            ]

        (prefill,) = pods_of("prefill")
        decodes = pods_of("decode")
        (gateway,) = pods_of("gateway")
        started = [prefill, *decodes, gateway]
        for pod in started:
            pod.start()
        # NOTE: every pod's probe asked in turn until each passed once: a pod's time to ready
        # is taken when its probe first passes, whatever the others do.
        ready_s: dict[str, float] = {}
        kinds = {pod.name: "startupProbe" if "startupProbe" in pod.main else "livenessProbe"
                 for pod in started}  # fmt: skip

        def all_ready() -> bool:
            for pod in started:
                if pod.name not in ready_s and probe(pod, kinds[pod.name]):
                    ready_s[pod.name] = round(time.monotonic() - pod.started_at, 1)
            return len(ready_s) == len(started)

        until(all_ready, START_TIMEOUT_S, "every pod's startup (gateway: liveness) probe", started)
        at = until(lambda: probe(gateway, "readinessProbe"), START_TIMEOUT_S,
                   "gateway readiness (/health: a registered pair)", started)  # fmt: skip
        ready_s["gateway /health"] = round(at - gateway.started_at, 1)
        if getattr(pytestconfig, "cache", None) is not None:  # NOTE: none: -p no:cacheprovider
            pytestconfig.cache.set("pdserve/image_ready_s", ready_s)
        print(f"podman run to ready, seconds: {ready_s}")
        try:
            yield Pods(gateway, prefill, decodes, docs, ready_s, smollm2.name)
        finally:
            for pod in reversed(started):
                pod.stop()


def program(argv: list[str]) -> tuple[str, ...]:
    """The program and subcommand a container runs: pdserve-gateway, pdserve certs issue,
    pdserve pull, python."""
    if argv[0] != "pdserve":
        return (argv[0],)
    return tuple(argv[:3]) if argv[1] == "certs" else tuple(argv[:2])


def chart_containers() -> tuple[list[dict[str, Any]], set[int], dict[str, Any]]:
    """Every container of the pdserve image in the chart rendered with each of `VALUE_SETS`;
    the ports the default values declare; the pods' security context."""
    containers: list[dict[str, Any]] = []
    ports: set[int] = set()
    security: dict[str, Any] = {}
    for values in VALUE_SETS:
        for doc in helm_template(values | image_values()):
            spec = doc.get("spec", {})
            spec = spec["template"]["spec"] if "template" in spec else spec
            for container in [*spec.get("initContainers", []), *spec.get("containers", [])]:
                if container["image"] != IMAGE:
                    continue
                containers.append(container)
                security = spec["securityContext"]
                if not values:
                    ports |= {port["containerPort"] for port in container.get("ports", [])}
    return containers, ports, security


def test_the_chart_and_the_image_agree(image: str) -> None:
    """Every command, flag, environment variable and port of every pdserve container in the
    chart (rendered with several value sets), and the pods' user, are ones the image answers
    to; the model the chart names is inside."""
    containers, declared_ports, security = chart_containers()
    argvs = [[*c["command"], *c.get("args", [])] for c in containers]
    programs = sorted({program(argv) for argv in argvs})
    assert len(programs) >= 6, f"the renders lack pdserve programs: {programs}"

    # Each program's --help, whether it is on PATH, and the variables pdserve reads (its
    # ENV_* names), asked of the image in one container without a network.
    script = (
        "import json, shutil, subprocess, sys\n"
        "from pdserve.common import env\n"
        "programs = json.loads(sys.argv[1])\n"
        "helps = {' '.join(p): subprocess.run([*p, '--help'], capture_output=True, text=True,"
        " check=False).stdout if p[0] != 'python' else '' for p in programs}\n"
        "found = {p[0]: shutil.which(p[0]) for p in programs}\n"
        "names = sorted(v for k, v in vars(env).items() if k.startswith('ENV_'))\n"
        "print(json.dumps({'helps': helps, 'found': found, 'env': names}))\n"
    )
    done = podman("run", "--rm", "--network=none", image, "python", "-c", script,
                  json.dumps(programs), timeout_s=300)  # fmt: skip
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(answers["found"].values()), f"not on the image's PATH: {answers['found']}"
    downward: dict[tuple[str, str], list[list[str]]] = {}
    for container, argv in zip(containers, argvs, strict=True):
        name = " ".join(program(argv))
        if name != "python":
            assert answers["helps"][name], f"{name} --help printed nothing"
            for flag in (word.split("=", 1)[0] for word in argv if word.startswith("--")):
                assert re.search(
                    rf"(?<![\w-]){re.escape(flag)}(?![\w-])", answers["helps"][name]
                ), f"{container['name']}: {name} does not take {flag}"
        for entry in container.get("env", []):
            if "value" in entry:
                assert entry["name"] in answers["env"], f"the image reads no {entry['name']}"
            else:
                downward.setdefault((container["name"], entry["name"]), []).append(argv)
    # The downward API's pod name and address reach a service only through its args (the
    # kubelet expands them): each container uses each in some render (the pod name names the
    # certificate, so the renders without TLS have no use for it).
    for (container_name, variable), uses in downward.items():
        assert any(f"$({variable})" in " ".join(argv) for argv in uses), (
            f"{container_name}: {variable} is set and never used"
        )

    # The image runs as the pods' (non-root) user and declares every port the chart does.
    config = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert security["runAsNonRoot"] and int(security["runAsUser"]) != 0
    exposed = {int(port.split("/")[0]) for port in config.get("ExposedPorts", {})}
    assert declared_ports <= exposed, f"not exposed: {declared_ports - exposed}"
    # The model the chart names is prepared inside: resolved with no network.
    (model,) = {argv[argv.index("--model") + 1] for argv in argvs if "--model" in argv}
    podman("run", "--rm", "--network=none", image, "python", "-c",
           f"from pdserve.engine.model_store import resolve_model; print(resolve_model({model!r}))",
           timeout_s=120)  # fmt: skip


def test_the_pods_pass_their_probes_on_mutual_tls_and_serve_every_declared_port(pods: Pods) -> None:
    for pod in pods.all:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in pod.main:
                assert probe(pod, kind), f"{pod.name}: {kind} fails"
        for port in pod.main["ports"]:
            with socket.create_connection((pod.pod_ip, port["containerPort"]), timeout=5):
                pass
    for pod, event in ((pods.prefill, "prefill_started"),
                       *((decode, "decode_started") for decode in pods.decodes)):  # fmt: skip
        (record,) = pod.events(event)
        assert record["instance_id"] == pod.name
        assert record["internal_plane"] != "insecure"
        assert record["address"].startswith(pod.pod_ip)
    assert set(pods.ready_s) == {*(pod.name for pod in pods.all), "gateway /health"}


def test_a_chat_completion_equals_pdserve_up(pods: Pods, reference: Reference) -> None:
    assert chat(f"{pods.rest_url}/v1", pods.model) == reference.chat


async def test_a_decode_killed_mid_stream_is_migrated(pods: Pods, reference: Reference) -> None:
    """SIGKILL of the decode container holding the most streams, each past its first tokens:
    every stream ends with the tokens `pdserve up` gave, on the other decode."""
    for attempt in range(3):
        events = [asyncio.Event() for _ in STREAM_PROMPTS]
        streams = asyncio.create_task(
            _streams(f"{pods.rest_url}/v1", pods.model, [set_when_streaming(e, 8) for e in events])
        )
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 120)
        victim, running = await busiest_decode(pods)
        if running > 0 or attempt == 2:
            break
        os.kill(victim.host_pid(), signal.SIGCONT)
        assert await streams == reference.streams
    assert running > 0, "no decode held a running stream"
    victim.kill("KILL")
    assert victim.wait(30) == 128 + signal.SIGKILL
    assert not streams.done(), "the streams ended before the kill"
    assert await streams == reference.streams
    migrated = await counter_at(f"{pods.rest_url}/metrics", "pdserve_gateway_reschedules",
                                cause="decode_lost")  # fmt: skip
    assert migrated >= 1
    # The cluster keeps serving on the surviving decode.
    pods.decodes.remove(victim)
    assert await asyncio.to_thread(chat, f"{pods.rest_url}/v1", pods.model) == reference.chat


async def busiest_decode(pods: Pods) -> tuple[ContainerPod, int]:
    """The decode container with the most streams still running, and that count, frozen
    (SIGSTOP to its process) so none of them ends before the kill; the others run on. Read
    from the logs as `support.process_cluster.busiest_decode` does: every decode frozen while
    the count settles."""
    pids = {pod.name: pod.host_pid() for pod in pods.decodes}
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    victim = pods.decodes[0]
    try:
        running: list[int] = []
        for _ in range(20):
            await asyncio.sleep(0.3)
            finished = {e["request_id"] for e in pods.gateway.events("request_finished")}
            counted = [
                len({e["request_id"] for e in d.events("lease_committed")} - finished)
                for d in pods.decodes
            ]
            if counted == running:
                break
            running = counted
        victim = pods.decodes[running.index(max(running))]
    finally:
        for pod in pods.decodes:
            if pod is not victim:
                os.kill(pids[pod.name], signal.SIGCONT)
    return victim, max(running)


def test_the_charts_helm_test_pod_answers(pods: Pods, image: str) -> None:
    (test_pod,) = [doc for doc in pods.docs if doc["kind"] == "Pod"]
    (tester,) = test_pod["spec"]["containers"]
    # NOTE: the gateway Service's name, pointed at the gateway pod.
    service = workload(pods.docs, "gateway")["metadata"]["name"]
    script = tester["args"][0].replace(f"{service}:", f"{pods.gateway.pod_ip}:")
    done = podman("run", "--rm", "--network=host", "--user", "10001:10001", tester["image"],
                  *tester["command"], script, timeout_s=300)  # fmt: skip
    assert done.stdout.strip(), "the first answer was empty"


def test_every_container_stops_cleanly_on_sigterm(pods: Pods) -> None:
    for pod in reversed(pods.all):
        assert pod.stop() == 0, f"{pod.name} did not stop cleanly\n{pod.log()[-3000:]}"
