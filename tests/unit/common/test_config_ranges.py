"""Config ranges live in field metadata and are checked in one place (`check_ranges`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdserve.common.config import check_ranges, describe_range
from pdserve.decode.config import DecodeConfig
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.gateway.config import GatewayConfig
from pdserve.prefill.config import PrefillConfig


@dataclass(frozen=True)
class Settings:
    count: int = field(default=1, metadata={"min": 1})
    ratio: float | None = field(default=None, metadata={"gt": 0, "max": 1})
    port: int = field(default=0, metadata={"min": 0, "max": 65535})
    delay_s: float = field(default=1.0, metadata={"gt": 0})
    mode: str = field(default="a", metadata={"choices": ("a", "b")})

    def __post_init__(self) -> None:
        check_ranges(self)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"count": 0}, "count must be >= 1, got 0"),
        ({"ratio": 0.0}, "ratio must be in (0, 1], got 0.0"),
        ({"ratio": 1.5}, "ratio must be in (0, 1], got 1.5"),
        ({"port": 65536}, "port must be in [0, 65535], got 65536"),
        ({"delay_s": 0.0}, "delay_s must be positive, got 0.0"),
        ({"delay_s": math.nan}, "delay_s must be a finite number, got nan"),
        ({"delay_s": math.inf}, "delay_s must be a finite number, got inf"),
        ({"mode": "c"}, "mode must be one of a, b, got 'c'"),
    ],
)
def test_a_value_outside_its_range_names_field_range_and_value(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        Settings(**changes)
    assert str(raised.value) == message


def test_values_at_the_edges_and_unset_ones_pass() -> None:
    Settings(count=1, ratio=1.0, port=65535, delay_s=1e-9, mode="b")
    Settings(ratio=None)


def test_describe_range() -> None:
    assert describe_range({"gt": 0}) == "positive"
    assert describe_range({"gt": 1}) == "> 1"
    assert describe_range({"min": 0}) == ">= 0"
    assert describe_range({"gt": 0, "max": 1}) == "in (0, 1]"


def _minimal(config_cls: type) -> dict[str, Any]:
    if config_cls in (GatewayConfig, PrefillConfig, DecodeConfig):
        return {"insecure": True}
    if config_cls is EngineConfig:
        return {"model": "unused"}
    return {}


def _ranged_fields() -> list[Any]:
    cases = []
    for config_cls in (GatewayConfig, PrefillConfig, DecodeConfig, EngineConfig, CacheConfig,
                       SchedulerConfig):  # fmt: skip
        for f in dataclasses.fields(config_cls):
            meta = f.metadata
            if "min" in meta:
                cases.append(pytest.param(config_cls, f.name, meta["min"] - 1, id=f"{f.name}-min"))
            elif "gt" in meta:
                cases.append(pytest.param(config_cls, f.name, meta["gt"], id=f"{f.name}-gt"))
            if "max" in meta:
                cases.append(pytest.param(config_cls, f.name, meta["max"] + 1, id=f"{f.name}-max"))
    return cases


@pytest.mark.parametrize(("config_cls", "name", "value"), _ranged_fields())
def test_every_service_refuses_each_ranged_setting_outside_its_range(
    config_cls: type, name: str, value: float
) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be "):
        config_cls(**_minimal(config_cls), **{name: value})


def test_the_services_declare_their_ranges() -> None:
    ranged = {
        f.name
        for config_cls in (GatewayConfig, PrefillConfig, DecodeConfig)
        for f in dataclasses.fields(config_cls)
        if "min" in f.metadata or "gt" in f.metadata
    }
    # NOTE: a few of each service's; the parametrized test above checks every one of them.
    assert {"max_attempts", "max_queued_requests", "max_queue_wait_s", "port"} <= ranged
    assert {"max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_fraction"} <= ranged
