"""The GPU kit and its one command, rehearsed on CPU: the kit's parts, its offline install, and
every step of tools/gpu_check.sh with tiny settings, down to a well-formed summary."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from pdserve.kv.transports import nixl

ROOT = Path(__file__).resolve().parents[2]
STEPS = [
    "install",
    "env",
    "model",
    "gpu_tests",
    "engine_bench",
    "graphs_bench",
    "kv_bench",
    "ipc_bench",
    "serve_compare",
]


def load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def strict_json(path: Path) -> dict:  # type: ignore[type-arg]
    def refuse(constant: str) -> None:
        raise ValueError(f"{path.name} holds {constant}: not strict JSON")

    return dict(json.loads(path.read_text(), parse_constant=refuse))


def test_the_kit_carries_what_the_image_lacks_and_never_torch() -> None:
    kit = load_tool("gpu_kit")
    carried = kit.missing_packages(kit.pinned_versions(ROOT / "constraints.txt"))
    # NOTE: the generated contract code needs its own protobuf and grpcio, whatever the image has.
    assert {"structlog", "fastcrc", "gguf", "protobuf", "grpcio", "pytest-asyncio"} <= set(carried)
    assert not {"torch", "numpy", "transformers", "tokenizers", "jinja2"} & set(carried)
    assert not any(name.startswith("nvidia-") for name in carried)
    assert carried["protobuf"] == kit.pinned_versions(ROOT / "constraints.txt")["protobuf"]


def test_nixl_rides_apart_as_the_images_cuda_build_of_the_tested_version() -> None:
    from importlib import metadata

    kit = load_tool("gpu_kit")
    pins = kit.pinned_versions(ROOT / "constraints.txt")
    # NOTE: a part of its own (`--no-nixl` leaves it out), not one of the dependencies.
    assert not any(name.startswith("nixl") for name in kit.missing_packages(pins))
    # NOTE: the CUDA 13 build of the very version the suite runs here (the CUDA 12 build).
    assert kit.nixl_packages(pins) == {"nixl-cu13": metadata.version("nixl-cu12")}


def test_a_file_split_across_parts_is_joined_and_a_damaged_piece_refused(tmp_path: Path) -> None:
    kit, check = load_tool("gpu_kit"), load_tool("gpu_check")
    big, small = tmp_path / "model.gguf", tmp_path / "a-1.0-py3-none-any.whl"
    big.write_bytes(os.urandom(2500))
    small.write_bytes(b"wheel")
    manifest = kit.pack([("model", big.name, big), ("wheel", small.name, small)], tmp_path, 1000)
    assert manifest["parts"] == ["part1", "part2", "part3"]
    for part in manifest["parts"]:
        (tmp_path / part / "kit.json").write_text(json.dumps({"python": "3.11", "model": None,
                                                               **manifest}))  # fmt: skip
    arrived = check.assemble(tmp_path, tmp_path / "joined")
    assert (tmp_path / "joined" / big.name).read_bytes() == big.read_bytes()
    assert arrived["wheels"] == [small.name] and arrived["model_file"] == big.name
    piece = tmp_path / "part2" / f"{big.name}.piece1"
    data = piece.read_bytes()
    piece.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # NOTE: b"x" left 1 in 256 unchanged
    assert check.assemble(tmp_path, tmp_path / "again")["damaged"] == [big.name]


def test_a_step_out_of_time_ends_with_what_it_started_and_the_next_still_runs(
    tmp_path: Path,
) -> None:
    check_tool = load_tool("gpu_check")
    args = argparse.Namespace(device="cpu", budget_s=60, target=tmp_path / "site",
                              python=sys.executable)  # fmt: skip
    check = check_tool.Check(args, tmp_path / "work")
    pid_file = tmp_path / "orphan.pid"
    # NOTE: setsid: a server a bench starts in a session of its own, out of the step's group.
    script = f"setsid sleep 300 & echo $! > {pid_file}; sleep 300"
    step = check.run("stuck", ["bash", "-c", script], 1.5)
    assert step.status == "timeout" and step.seconds < 10
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")
    assert not stat.exists() or stat.read_text().rsplit(") ", 1)[1].startswith("Z")  # gone
    assert check.run("next", ["true"], 30).status == "ok"
    assert [s.name for s in check.steps] == ["stuck", "next"]


# NOTE: the budget only bounds a run that hangs (the budget logic has a test of its own above):
# idle, the rehearsal takes about 40 s; a machine busy with other work may take several times
# that, and a step cut short by the budget would fail the case for the machine, not the code.
REHEARSAL_BUDGET_S = 800


@pytest.mark.slow
@pytest.mark.timeout(REHEARSAL_BUDGET_S + 100)
def test_the_gpu_check_rehearses_every_step_on_cpu_from_an_offline_kit(tmp_path: Path) -> None:
    kit, out, site = tmp_path / "kit", tmp_path / "out", tmp_path / "site"
    subprocess.run(
        [sys.executable, "tools/gpu_kit.py", "--rehearsal", "--out", str(kit)],
        cwd=ROOT, check=True, capture_output=True,
    )  # fmt: skip
    # NOTE: pdserve's wheels are pure: the GPU image's Python is not this one, and pip
    # refuses a wheel compiled for another (shared's CPU kernels stay out of the kit).
    manifest = json.loads(next(kit.glob("part*/kit.json")).read_text())
    ours = [entry["name"] for entry in manifest["files"] if entry["name"].startswith("pdserve")]
    assert len(ours) == 4 and all(name.endswith("-py3-none-any.whl") for name in ours), ours
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_PYTHON": sys.executable,
           "GPU_CHECK_BUDGET_S": str(REHEARSAL_BUDGET_S)}  # fmt: skip
    result = subprocess.run(
        ["bash", "tools/gpu_check.sh", "--kit", str(kit), "--out", str(out), "--target", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=REHEARSAL_BUDGET_S + 60,
    )  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json"]
    summary = strict_json(out / "summary.json")
    steps = {step["name"]: step for step in summary["steps"]}
    assert list(steps) == STEPS
    assert {name: step["status"] for name, step in steps.items()} == dict.fromkeys(STEPS, "ok"), (
        result.stdout[-3000:]
    )
    assert result.returncode == 0 and summary["is_ok"]
    assert summary["is_rehearsal"] and summary["attention_backend"] == "sdpa"
    # NOTE: the installed wheels, not this checkout's editable sources, come first.
    assert steps["env"]["results"]["pdserve_path"][0] == str(site / "pdserve")
    assert steps["gpu_tests"]["results"]["passed"] > 0
    assert "failed" not in steps["gpu_tests"]["results"]
    engine = steps["engine_bench"]["results"]["summary"]
    assert engine["greedy_outputs_identical_to_hf"] == "8/8"
    assert engine["attention_backend"] == "sdpa"
    graphs = steps["graphs_bench"]["results"]
    assert graphs["capture"] == "StandInCapture" and graphs["buckets"] == [1, 2, 4]
    assert [row["batch_size"] for row in graphs["rows"]] == [1, 4]
    # NOTE: the bench runs nixl where its extra is installed (the rehearsal's Python has it).
    with_nixl = {"nixl"} if nixl.is_installed() else set()
    assert (summary["nixl"] is not None) == bool(with_nixl), steps["env"]["results"]
    assert set(steps["kv_bench"]["results"]["transports"]) == {"grpc", "tcp", "shm", *with_nixl}
    ipc = steps["ipc_bench"]["results"]
    assert ipc["bit_exact"] and ipc["device_kind"] == "cpu"  # the stand-in
    merged = steps["serve_compare"]["results"]["merged"]
    assert merged["pdserve"]["num_errors"] == merged["colocated"]["num_errors"] == 0
    with tarfile.open(out / "logs.tar.gz") as archive:
        names = set(archive.getnames())
    assert {f"logs/{name}.log" for name in STEPS} <= names
