"""``--dtype auto``: bfloat16 where the CPU has native bf16, float32 elsewhere, and why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine import EngineConfig, ModelRunner, rank_model
from pdserve.engine.precision import choose_dtype, cpu_flags

CPU = torch.device("cpu")
HAS_ONEDNN_BF16 = torch.backends.mkldnn.is_available() and bool(
    torch.ops.mkldnn._is_mkldnn_bf16_supported()
)


@pytest.mark.skipif(not HAS_ONEDNN_BF16, reason="torch runs no bf16 through oneDNN here")
@pytest.mark.parametrize("flag", ["avx512_bf16", "amx_bf16"])
def test_auto_is_bfloat16_on_a_cpu_with_native_bf16(flag: str) -> None:
    choice = choose_dtype("auto", CPU, frozenset({"avx512f", flag}))
    assert (choice.dtype, choice.reason, choice.cpu_bf16_flags) == (
        "bfloat16",
        "cpu_native_bf16",
        (flag,),
    )


def test_auto_is_float32_without_native_bf16_and_off_the_cpu() -> None:
    # AVX-512 alone emulates bf16: no faster than float32, and less exact.
    choice = choose_dtype("auto", CPU, frozenset({"avx512f", "avx512bw"}))
    assert (choice.dtype, choice.reason) == ("float32", "cpu_without_native_bf16")
    choice = choose_dtype("auto", torch.device("cuda"), frozenset({"avx512_bf16"}))
    assert (choice.dtype, choice.reason) == ("float32", "not_a_cpu")


def test_an_explicit_dtype_is_kept() -> None:
    choice = choose_dtype("float32", CPU, frozenset({"avx512_bf16"}))
    assert (choice.dtype, choice.reason) == ("float32", "requested")


def test_cpu_flags_come_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(cpuinfo) == {"fpu", "sse2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "absent") == frozenset()


def test_engine_config_defaults_to_auto_and_the_cache_follows_the_weights() -> None:
    config = EngineConfig(model="m")
    assert config.dtype == "auto"
    assert config.torch_dtype == getattr(torch, config.dtype_choice.dtype)
    assert config.cache_dtype == config.torch_dtype
    assert EngineConfig(model="m", dtype="bfloat16").cache_dtype == torch.bfloat16


def test_start_up_says_which_dtype_runs_and_why(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[dict[str, Any]] = []

    class Recorder:
        def info(self, event: str, **fields: Any) -> None:
            events.append({"event": event, **fields})

    # NOTE: a recorder rather than structlog's capture: another test may have configured
    # structlog to cache its loggers already.
    monkeypatch.setattr(rank_model, "log", Recorder())
    runner = ModelRunner.load(EngineConfig(model=str(tiny_model_dir), max_model_len=64))
    [event] = [e for e in events if e["event"] == "dtype_resolved"]
    choice = choose_dtype("auto", CPU)
    assert event["requested"] == "auto"
    assert (event["dtype"], event["reason"]) == (choice.dtype, choice.reason)
    assert runner.kv_cache.kv.dtype == getattr(torch, choice.dtype)
