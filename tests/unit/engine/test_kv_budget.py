"""KV cache sizing: the arithmetic of an automatic size, the memory it reads, and the choice
between a given count, a given budget and an automatic size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine import kv_budget, rank_model
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.kv_budget import (
    auto_num_blocks,
    cgroup_available_bytes,
    host_available_bytes,
    size_kv_cache,
)
from pdserve.engine.kv_cache import KVCacheLayout
from pdserve.engine.runner import ModelRunner

MIB = 1 << 20
GIB = 1 << 30

# The demo model's layout: 4 layers, 2 KV heads of 32, float32: 32 KiB per block of 16.
DEMO_LAYOUT = KVCacheLayout(
    num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32"
)


def test_a_fraction_of_the_available_memory() -> None:
    assert auto_num_blocks(MIB, 10 * GIB, 0.1) == 1024
    assert auto_num_blocks(MIB, 10 * GIB, 0.5) == 5120


def test_the_byte_cap_wins_over_the_fraction() -> None:
    assert auto_num_blocks(MIB, 100 * GIB, 0.1, max_bytes=4 * GIB) == 4096


def test_no_more_blocks_than_the_engine_can_hold() -> None:
    assert auto_num_blocks(MIB, 100 * GIB, 0.1, max_bytes=4 * GIB, max_blocks=300) == 300


def test_the_reserve_is_left_out_of_the_budget() -> None:
    assert auto_num_blocks(MIB, 10 * GIB, 0.5, reserve_bytes=512 * MIB) == 5120 - 512


def test_raised_to_one_longest_sequence_when_half_the_memory_holds_it() -> None:
    # 0.1 of 1 GiB is 102 blocks; one sequence needs 300 and half the memory holds 512.
    assert auto_num_blocks(MIB, GIB, 0.1, min_blocks=300) == 300
    # Half the memory holds only 512 of the 600 wanted.
    assert auto_num_blocks(MIB, GIB, 0.1, min_blocks=600) == 512
    # The floor stays within the byte cap.
    assert auto_num_blocks(MIB, GIB, 0.1, max_bytes=200 * MIB, min_blocks=600) == 200


def test_the_floor_does_not_lift_a_fraction_that_already_holds_it() -> None:
    assert auto_num_blocks(MIB, 10 * GIB, 0.1, min_blocks=16) == 1024


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((MIB, 1000, 0.1), {}),  # not one block fits
        ((MIB, GIB, 0.0), {}),
        ((MIB, GIB, 1.5), {}),
        ((0, GIB, 0.1), {}),
        ((MIB, GIB, 0.9), {"reserve_bytes": 2 * GIB}),
    ],
)
def test_impossible_sizes_raise(args: tuple[int, int, float], kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        auto_num_blocks(*args, **kwargs)


def _meminfo(tmp_path: Path, available_kb: int | None) -> Path:
    path = tmp_path / "meminfo"
    lines = ["MemTotal:       24000000 kB", "MemFree:        20000000 kB"]
    if available_kb is not None:
        lines.append(f"MemAvailable:   {available_kb} kB")
    path.write_text("\n".join(lines) + "\n")
    return path


def _cgroup(tmp_path: Path, files: dict[str, str], own: str = "/") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    root.mkdir(exist_ok=True)
    proc_self = tmp_path / "proc-self-cgroup"
    proc_self.write_text(f"0::{own}\n")
    return root, proc_self


def test_available_memory_is_mem_available(tmp_path: Path) -> None:
    root, proc_self = _cgroup(tmp_path, {})
    meminfo = _meminfo(tmp_path, 8 * MIB)  # kB
    assert host_available_bytes(meminfo, root, proc_self) == 8 * GIB


def test_without_mem_available_the_free_pages_count(tmp_path: Path) -> None:
    root, proc_self = _cgroup(tmp_path, {})
    assert host_available_bytes(_meminfo(tmp_path, None), root, proc_self) > 0
    assert host_available_bytes(tmp_path / "absent", root, proc_self) > 0


def test_a_cgroup_limit_below_mem_available_wins(tmp_path: Path) -> None:
    root, proc_self = _cgroup(
        tmp_path, {"memory.max": str(6 * GIB), "memory.current": str(2 * GIB)}
    )
    meminfo = _meminfo(tmp_path, 20 * MIB)
    assert host_available_bytes(meminfo, root, proc_self) == 4 * GIB


def test_a_cgroup_limit_above_mem_available_does_not_count(tmp_path: Path) -> None:
    root, proc_self = _cgroup(tmp_path, {"memory.max": str(60 * GIB), "memory.current": "0"})
    assert host_available_bytes(_meminfo(tmp_path, 8 * MIB), root, proc_self) == 8 * GIB


def test_the_reclaimable_file_cache_counts_as_available(tmp_path: Path) -> None:
    files = {
        "memory.max": str(6 * GIB),
        "memory.current": str(3 * GIB),
        "memory.stat": f"anon {GIB}\nfile {2 * GIB}\nactive_file {GIB}\ninactive_file {GIB}",
    }
    root, proc_self = _cgroup(tmp_path, files)
    assert cgroup_available_bytes(root, proc_self) == 4 * GIB


def test_the_process_own_cgroup_is_read_first(tmp_path: Path) -> None:
    files = {
        "memory.max": "max",
        "pods/p1/memory.max": str(3 * GIB),
        "pods/p1/memory.current": str(GIB),
    }
    root, proc_self = _cgroup(tmp_path, files, own="/pods/p1")
    assert cgroup_available_bytes(root, proc_self) == 2 * GIB


def test_no_cgroup_limit(tmp_path: Path) -> None:
    root, proc_self = _cgroup(tmp_path, {"memory.max": "max", "memory.current": "5"})
    assert cgroup_available_bytes(root, proc_self) is None
    unlimited_v1 = {
        "memory/memory.limit_in_bytes": str(9223372036854771712),
        "memory/memory.usage_in_bytes": "5",
    }
    root, proc_self = _cgroup(tmp_path / "v1", unlimited_v1)
    assert cgroup_available_bytes(root, proc_self) is None


def test_a_cgroup_v1_limit(tmp_path: Path) -> None:
    files = {
        "memory/memory.limit_in_bytes": str(2 * GIB),
        "memory/memory.usage_in_bytes": str(GIB),
        "memory/memory.stat": f"cache 0\ninactive_file 7\ntotal_inactive_file {GIB // 2}",
    }
    root, proc_self = _cgroup(tmp_path, files)
    assert cgroup_available_bytes(root, proc_self) == GIB + GIB // 2


def _auto(max_seqs: int = 64, **cache: object) -> kv_budget.KvCacheSize:
    return size_kv_cache(
        CacheConfig(**cache),  # type: ignore[arg-type]
        DEMO_LAYOUT,
        torch.device("cpu"),
        max_model_len=2048,
        max_seqs=max_seqs,
    )


def test_explicit_settings_win() -> None:
    assert _auto(num_blocks=7, memory_bytes=GIB) == (7, "num_blocks", None, None)
    assert _auto(memory_bytes=256 * MIB) == (8192, "memory_mb", None, None)


def test_automatic_size_is_a_tenth_of_ram_at_most_4_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 2 * GIB)
    size = _auto()
    assert size == (2 * GIB // 10 // (32 * 1024), "auto", 2 * GIB, 0.1)
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 100 * GIB)
    assert _auto(memory_fraction=0.9, max_seqs=10**6).num_blocks == 4 * GIB // (32 * 1024)


def test_on_a_gpu_nine_tenths_of_its_free_memory_less_an_activation_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 1 * GIB)
    monkeypatch.setattr(kv_budget, "device_free_bytes", lambda device: 10 * GIB)
    size = size_kv_cache(
        CacheConfig(), DEMO_LAYOUT, torch.device("cuda:0"), max_model_len=2048, max_seqs=10**6
    )
    # No 4 GiB cap on a GPU.
    assert size == ((9 * GIB - 512 * MIB) // (32 * 1024), "auto", 10 * GIB, 0.9)


def test_the_demo_model_takes_no_more_than_its_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 500 * GIB)
    # 64 sequences (plus one) of 2048 tokens: 128 blocks each, 260 MiB.
    assert _auto().num_blocks == 65 * 128


def test_a_decode_in_shm_takes_at_most_half_its_free_space(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 20 * GIB)
    monkeypatch.setattr(kv_budget, "free_space_bytes", lambda directory: 100 * MIB)
    assert _auto(shm_dir="/dev/shm").num_blocks == 50 * MIB // (32 * 1024)
    assert _auto().num_blocks == 65 * 128
    # A segment too small for one sequence leaves the size alone (the decode then offers
    # its other transports).
    monkeypatch.setattr(kv_budget, "free_space_bytes", lambda directory: 4 * MIB)
    assert _auto(shm_dir="/dev/shm").num_blocks == 65 * 128


def test_the_runner_logs_the_chosen_size_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: 20 * GIB)
    logs: list[dict[str, Any]] = []

    class Recorder:
        def info(self, event: str, **fields: Any) -> None:
            logs.append({"event": event, **fields})

    # NOTE: a recorder rather than structlog's capture: another test may have configured
    # structlog to cache its loggers already.
    monkeypatch.setattr(rank_model, "log", Recorder())
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=256)
    runner = ModelRunner.load(config)
    sized = [record for record in logs if record["event"] == "kv_cache_sized"]
    assert len(sized) == 1
    # The tiny model: 2 layers, 2 KV heads of 16, float32: 8 KiB per block of 16; 64 + 1
    # sequences of 256 tokens.
    assert sized[0]["source"] == "auto"
    assert sized[0]["num_blocks"] == runner.kv_cache.num_blocks == 65 * 16
    assert sized[0]["num_tokens"] == 65 * 256
    assert sized[0]["bytes"] == runner.kv_cache.nbytes == 65 * 16 * 8192
    assert sized[0]["available_bytes"] == 20 * GIB
    assert sized[0]["fraction"] == 0.1
