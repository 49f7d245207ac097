"""The CUDA path in one run on a lent GPU (`tools/gpu_check.sh` runs this; standard library only).

Reads only the kit (``make gpu-kit``: .gpukit/part*) and this repository. Steps, each a process
of its own under its own time limit, in a total budget that ends well inside a 10-minute call;
a step that fails or runs out of time does not stop the next:

1. ``install``: joins the kit's pieces, checks every digest, and installs the wheels offline
   (``pip install --no-index --no-deps --target``); later steps run with that folder first on
   ``PYTHONPATH`` over the image's own packages.
2. ``env``: the GPU, torch, CUDA, the flash-attn and the NIXL found, and the attention backend
   the engine picks for bf16 on this device.
3. ``model``: the default model's GGUF into a fresh cache and prepared there (the demo model
   when the kit's model part did not arrive).
4. ``gpu_tests``: the engine on CUDA against CPU logits (SDPA and flash-attn where importable),
   the CUDA block export/import, CUDA-graph decode replay against eager on the default model,
   a CUDA cache mapped through CUDA IPC by another process, bf16 KV through every transport
   into a decode process (CUDA IPC included, and NIXL VRAM to VRAM where the kit carries it).
5. ``engine_bench``: bench/engine.py on the real model, engine vs transformers' generate.
6. ``graphs_bench``: bench/decode_graphs.py, decode steps from CUDA graphs vs eager at batch
   1, 16 and 64.
7. ``kv_bench``: bench/kv_transfer.py from a CUDA cache, each transport (NIXL where the kit
   carried it) vs raw TCP and an in-process device-to-device copy.
8. ``ipc_bench``: bench/kv_cuda_ipc.py, writes into another process's CUDA cache through CUDA
   IPC vs the same copy within one process.
9. ``serve_compare``: bench/serve.py --compare, PD vs colocated on the same device.

Writes ``summary.json`` (each step's status, seconds, results; GPU, torch, attention backend)
and ``logs.tar.gz`` (every step's log and the benches' result files) to ``$OUT`` (or --out).
``GPU_CHECK_DEVICE=cpu`` (or --device cpu) rehearses the same steps with tiny settings on CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2-135m-instruct"
GPU_TESTS = (
    "tests/unit/engine/test_engine_gpu.py",
    "tests/unit/engine/test_attention_backend.py",
    "tests/unit/engine/test_decode_graphs_gpu.py",
    # NOTE: the last two: a rehearsal on CPU leaves them out (make test runs them on its own).
    "tests/unit/kv/test_cache_ipc_processes.py",
    "tests/e2e/test_kv_transports_bf16.py",
)
ENV_PROBE = r"""
import json, torch
from pdserve.engine.flash_attention import FLASH
from pdserve.engine.rank_model import attention_backend_name, resolve_attention_backend
device = torch.device(DEVICE)
info = {"torch": torch.__version__, "cuda": torch.version.cuda,
        "is_cuda_available": torch.cuda.is_available(),
        "flash_attn": FLASH.name if FLASH else None,
        "pdserve_path": list(__import__("pdserve").__path__)}
if device.type == "cuda":
    props = torch.cuda.get_device_properties(device)
    info["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                   "memory_gib": round(props.total_memory / 2**30, 1)}
backend = resolve_attention_backend("auto", device, torch.bfloat16, 16)
info["attention_backend"] = attention_backend_name(backend)
import google.protobuf, grpc
info["protobuf"], info["grpcio"] = google.protobuf.__version__, grpc.__version__
from pdserve.kv.transports import nixl
try:
    info["nixl"] = nixl.load_api().__name__.split(".")[0]
except nixl.NixlUnavailable as error:
    info["nixl"], info["nixl_error"] = None, str(error)
print(json.dumps(info))
"""
MODEL_PROBE = r"""
import json, shutil, sys
from pdserve.engine.model_store import KNOWN_MODELS, known_gguf_path, resolve_model
if len(sys.argv) > 2:  # a known model's GGUF from the kit: where the cache keeps it
    target = known_gguf_path(KNOWN_MODELS[sys.argv[1]])
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sys.argv[2], target)
resolved = resolve_model(sys.argv[1])
print(json.dumps({"model": resolved.name, "path": str(resolved.path)}))
"""


@dataclass
class Step:
    """One step's record in the summary."""

    name: str
    status: str = "skipped"
    seconds: float = 0.0
    timeout_s: float = 0.0
    returncode: int | None = None
    log: str = ""
    results: dict[str, Any] = field(default_factory=dict)


MARKER = "PDSERVE_GPU_CHECK_STEP"
"""Set in each step's environment (inherited by whatever it starts) to find what it left."""


def kill_marked(marker: str) -> None:
    """Kills every process whose environment carries `marker`: what a step started that
    outlived it (services start in sessions of their own, out of the step's process group)."""
    needle = f"{MARKER}={marker}".encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(entry)
        except (OSError, ValueError):
            continue
    # NOTE: the next step starts once they are gone (their ports and files free), within 5 s.
    deadline = time.monotonic() + 5.0
    while killed and time.monotonic() < deadline:
        killed = [entry for entry in killed if _is_alive(entry)]
        if killed:
            time.sleep(0.02)


def _is_alive(entry: Path) -> bool:
    """Whether the process of /proc/<pid> `entry` still runs (not gone, not a zombie)."""
    try:
        return not (entry / "stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False


class Check:
    """Runs the steps under one deadline and keeps their records."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.is_gpu = args.device != "cpu"
        self.work = work
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        self.deadline = time.monotonic() + args.budget_s
        self.steps: list[Step] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(args.target), os.environ.get("PYTHONPATH", "")])
            ),
            "PYTHONUNBUFFERED": "1",
            "PDSERVE_CACHE_DIR": str(work / "cache"),
            "PDSERVE_BENCH_RESULTS_DIR": str(self.logs / "results"),
        }

    def run(self, name: str, command: list[str], timeout_s: float) -> Step:
        """Runs `command` in its own process group, output to logs/<name>.log; on time out
        the whole group is killed (benches start servers of their own)."""
        step = Step(name, log=f"logs/{name}.log")
        self.steps.append(step)
        left = self.deadline - time.monotonic() - 5
        if left < 10:
            step.results["reason"] = "the check's time budget is spent"
            return step
        step.timeout_s = round(min(timeout_s, left))
        log_path = self.logs / f"{name}.log"
        began = time.monotonic()
        print(f"[gpu_check] {name}: up to {step.timeout_s} s", flush=True)
        marker = f"{name}-{os.getpid()}-{began}"
        with log_path.open("w") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            process = subprocess.Popen(
                command, cwd=ROOT, env={**self.env, MARKER: marker}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            try:
                step.returncode = process.wait(step.timeout_s)
                step.status = "ok" if step.returncode == 0 else "failed"
            except subprocess.TimeoutExpired:
                step.status = "timeout"
            finally:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                kill_marked(marker)
        step.seconds = round(time.monotonic() - began, 1)
        print(f"[gpu_check] {name}: {step.status} in {step.seconds} s", flush=True)
        return step

    def output(self, step: Step) -> str:
        return (self.logs / f"{step.name}.log").read_text(errors="replace")


def assemble(kit: Path, into: Path) -> dict[str, Any]:
    """Joins the pieces of every file the kit's manifest lists; returns what arrived."""
    manifests = sorted(kit.glob("part*/kit.json"))
    if not manifests:
        raise SystemExit(f"no kit in {kit} (part*/kit.json): run make gpu-kit and carry it")
    manifest = json.loads(manifests[0].read_text())
    into.mkdir(parents=True, exist_ok=True)
    found, missing, damaged = [], [], []
    for entry in manifest["files"]:
        pieces = [kit / part / piece for part, piece in entry["pieces"]]
        if not all(piece.is_file() for piece in pieces):
            missing.append(entry["name"])
            continue
        target = into / entry["name"]
        digest = hashlib.sha256()
        with target.open("wb") as sink:
            for piece in pieces:
                with piece.open("rb") as source:
                    while chunk := source.read(1 << 20):
                        digest.update(chunk)
                        sink.write(chunk)
        if digest.hexdigest() != entry["sha256"]:
            damaged.append(entry["name"])
            target.unlink()
        else:
            found.append(entry)
    return {
        "python": manifest["python"],
        "model": manifest["model"],
        "parts_expected": manifest["parts"],
        "parts_found": sorted(p.parent.name for p in manifests),
        "wheels": [e["name"] for e in found if e["kind"] == "wheel"],
        "model_file": next((e["name"] for e in found if e["kind"] == "model"), None),
        "missing": missing,
        "damaged": damaged,
    }


def strict(value: Any) -> Any:
    """`value` with NaN and infinities as None, so that the summary is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict(item) for item in value]
    return value


def last_json(text: str) -> dict[str, Any]:
    """The last line of `text` that parses as a JSON object ({} if none)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return {}


def bench_results(check: Check, step: Step) -> dict[str, Any]:
    """The result file a bench names on its ``results: PATH`` line, loaded."""
    match = re.search(r"^results: (\S+)", check.output(step), re.MULTILINE)
    try:
        return dict(json.loads(Path(match.group(1)).read_text())) if match else {}
    except (OSError, ValueError):
        return {}


def run_steps(check: Check) -> dict[str, Any]:
    args, python = check.args, str(check.args.python)
    files = check.work / "files"
    kit = assemble(args.kit, files)
    shutil.rmtree(args.target, ignore_errors=True)
    wheels = [str(files / name) for name in kit["wheels"]]
    step = check.run(
        "install",
        [python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
         "--no-cache-dir", "--disable-pip-version-check", "-q", "--target", str(args.target),
         *wheels],
        120,
    )  # fmt: skip
    step.results = {"num_wheels": len(wheels), "missing": kit["missing"], "damaged": kit["damaged"]}
    if list(args.target.glob("*.pth")):
        # NOTE: a --target folder on PYTHONPATH is no site directory, so its .pth files (the
        # CuTe DSL's puts its packages on sys.path) would not run: this makes them run.
        (args.target / "sitecustomize.py").write_text(
            f"import site\nsite.addsitedir({str(args.target)!r})\n"
        )

    step = check.run("env", [python, "-c", f"DEVICE = {args.device!r}\n" + ENV_PROBE], 90)
    env = last_json(check.output(step))
    step.results = env

    model, gguf = "demo", []
    if check.is_gpu and kit["model_file"]:
        model, gguf = kit["model"]["name"], [str(files / kit["model_file"])]
    step = check.run("model", [python, "-c", MODEL_PROBE, model, *gguf], 180)
    step.results = last_json(check.output(step))
    if check.is_gpu and model == "demo":
        step.results["reason"] = "the kit's model file did not arrive: the benches use demo"
    if step.status != "ok":
        model = "demo"

    step = check.run(
        "gpu_tests",
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "--import-mode=importlib", "--junitxml", str(check.logs / "gpu_tests.xml"),
         *(GPU_TESTS if check.is_gpu else GPU_TESTS[:-2])],
        240,
    )  # fmt: skip
    tail = check.output(step).strip().splitlines()[-1:] or [""]
    step.results = {
        kind: int(count)
        for count, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", tail[0])
    }

    dtype = "bfloat16" if check.is_gpu else "float32"
    engine = [python, "bench/engine.py", "--model", model, "--device", args.device,
              "--dtype", dtype, "--skip-sequential"]  # fmt: skip
    # NOTE: the rehearsal's torch on one thread: two threads on cores another job keeps busy
    # wait on each other at every op (13.6 s idle, over 210 s beside two busy loops)
    engine += (
        ["--rounds", "2"] if check.is_gpu else ["--quick", "--latency-runs", "1", "--threads", "1"]
    )
    step = check.run("engine_bench", engine, 210)
    results = bench_results(check, step)
    step.results = {"summary": results.get("summary"), "config": results.get("config")}

    graphs = [python, "bench/decode_graphs.py", "--model", model, "--device", args.device,
              "--dtype", dtype]  # fmt: skip
    graphs += [] if check.is_gpu else ["--quick"]
    step = check.run("graphs_bench", graphs, 120)
    step.results = bench_results(check, step).get("summary") or {}

    kv = [python, "bench/kv_transfer.py", "--device", args.device, "--dtype", dtype, "--json"]
    # NOTE: 4 MiB at least: smaller transfers of this bench's wide model stall on CPU.
    kv += ["--sizes-mib", *(["64", "256"] if check.is_gpu else ["4"])]
    kv += ["--repeats", "2" if check.is_gpu else "1"]
    step = check.run("kv_bench", kv, 120)
    step.results = last_json(check.output(step))

    ipc = [python, "bench/kv_cuda_ipc.py", "--device", args.device, "--dtype", dtype, "--json"]
    ipc += ["--sizes-mib", "64", "256", "--repeats", "3"] if check.is_gpu else ["--sizes-mib", "4"]
    step = check.run("ipc_bench", ipc, 60)
    step.results = last_json(check.output(step))

    serve = [python, "bench/serve.py", "--compare", "--device", args.device, "--dtype", dtype,
             "--model-preset", "smollm2" if model != "demo" else "demo"]  # fmt: skip
    if check.is_gpu:
        serve += ["--num-blocks", "4096", "--rounds", "2", "--num-requests", "64",
                  "--concurrency", "16", "--pd-threads", "4",
                  "--colocated-threads", "4"]  # fmt: skip
    else:
        serve += ["--rounds", "1", "--num-requests", "4", "--concurrency", "2",
                  "--prompt-len", "16:32", "--output-len", "4:8"]  # fmt: skip
    step = check.run("serve_compare", serve, 240)
    results = bench_results(check, step)
    step.results = {
        key: results.get(key) for key in ("merged", "ratios_pdserve_over_colocated", "settings")
    }
    return {"kit": kit, "env": env, "model": model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kit", type=Path, default=ROOT / ".gpukit")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT") or ROOT / "gpu-check")
    parser.add_argument("--device", default=os.environ.get("GPU_CHECK_DEVICE", "cuda"))
    parser.add_argument("--python", default=sys.executable, help="the Python the steps run")
    parser.add_argument(
        "--target", type=Path, default=Path(tempfile.gettempdir()) / "pdserve-gpukit-site"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=float(os.environ.get("GPU_CHECK_BUDGET_S", "540")),
        help="all steps together (a device call may run 600 s)",
    )
    args = parser.parse_args()
    began = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        check = Check(args, Path(scratch))
        context: dict[str, Any] = {}
        try:
            context = run_steps(check)
        finally:
            env = context.get("env", {})
            summary = {
                "device": args.device,
                "is_rehearsal": not check.is_gpu,
                "gpu": env.get("gpu"),
                "torch": env.get("torch"),
                "cuda": env.get("cuda"),
                "attention_backend": env.get("attention_backend"),
                "flash_attn": env.get("flash_attn"),
                "nixl": env.get("nixl"),
                "model": context.get("model"),
                "kit": context.get("kit"),
                "is_ok": bool(check.steps) and all(s.status == "ok" for s in check.steps),
                "seconds": round(time.monotonic() - began, 1),
                "steps": [asdict(step) for step in check.steps],
            }
            summary = strict(summary)
            text = json.dumps(summary, indent=2, allow_nan=False)
            (args.out / "summary.json").write_text(text + "\n")
            with tarfile.open(args.out / "logs.tar.gz", "w:gz") as archive:
                archive.add(check.logs, arcname="logs")
            print(json.dumps({k: summary[k] for k in ("device", "gpu", "torch",
                  "attention_backend", "model", "is_ok", "seconds")}))  # fmt: skip
            print(" ".join(f"{s.name}={s.status}({s.seconds}s)" for s in check.steps))
    sys.exit(0 if summary["is_ok"] else 1)


if __name__ == "__main__":
    main()
