"""``--registry`` values and the settings that depend on them."""

from __future__ import annotations

import pytest

from pdserve.common.etcd_registry import EtcdTarget
from pdserve.gateway.config import GatewayConfig
from pdserve.launcher.__main__ import main as pdserve_main
from pdserve.serving.config import InstanceConfig


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        ("etcd://10.0.0.5:2379", b"/pdserve/v1/instances/decode/d-1"),
        ("etcd://etcd.local:2379/prod", b"/prod/pdserve/v1/instances/decode/d-1"),
        ("etcd://[::1]:2379/prod/", b"/prod/pdserve/v1/instances/decode/d-1"),
    ],
)
def test_instance_keys_live_under_the_namespace(spec: str, key: bytes) -> None:
    assert EtcdTarget.parse(spec).instance_key("decode", "d-1") == key


@pytest.mark.parametrize(
    "spec", ["http://127.0.0.1:2379", "etcd://127.0.0.1", "etcd://:2379", "127.0.0.1:2379"]
)
def test_other_registry_values_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="etcd://HOST:PORT"):
        EtcdTarget.parse(spec)
    with pytest.raises(ValueError, match="--registry"):
        GatewayConfig(insecure=True, registry=spec)


def test_an_instance_registers_in_one_place() -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        InstanceConfig(insecure=True, gateway="127.0.0.1:50051", registry="etcd://h:2379")
    with pytest.raises(ValueError, match="below registry_ttl_s"):
        InstanceConfig(
            insecure=True, registry="etcd://h:2379", registry_ttl_s=2, heartbeat_interval_s=2
        )


def test_pdserve_up_refuses_several_gateways_without_a_shared_registry(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert pdserve_main(["up", "--gateways", "2", "--model", "demo"]) == 2
    assert "--gateways 2 needs --registry etcd://HOST:PORT" in capsys.readouterr().err
