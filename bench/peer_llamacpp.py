"""pdserve against llama.cpp's server on the same GGUF, driven by a third-party load generator.

    python bench/peer_llamacpp.py --llama-server PATH/llama-server --aiperf PATH/aiperf
    python bench/peer_llamacpp.py ... --pdserve-args "--decode-args=--quantization int8" \\
        --label int8        # another pdserve configuration, same peer

Both servers run the default model (SmolLM2-135M-Instruct): llama.cpp straight from its Q4_1
GGUF, pdserve from the same file prepared into its cache. Each measurement starts a fresh
server (no prompt cached), then AIPerf (`aiperf profile`, PyPI) drives streaming chat
completions: input of about ``--isl`` tokens, ``--osl`` output tokens (``ignore_eos``), at
each ``--concurrency``, ``--requests-per-client`` requests per client. The servers run one
after the other on the same machine; the table gives output tokens/s, TTFT and ITL (p50) of
each and the ratios pdserve / llama.cpp, and the memory of each side after its run: the PSS of
every process the server started, idle for ``--idle-s`` seconds after the load, and the pages of
its shared-memory files that no process has touched yet (pdserve's decode KV, allocated whole at
start and sized to the peer's context, ``--match-kv``).
The CPU flags and both servers' settings are printed and written to
bench/results/peer-llamacpp-<time>.json.

The peer's setup follows shared/PEERS.md: llama-server built from the llama.cpp sources that
PyPI's `llama-cpp-python` sdist vendors, one slot per client (``-np``), the context to match,
``-t`` threads (``--llama-threads``; 1 was its best on 2 cores beside the load generator).
``--context 32768 --concurrency 8`` gives both the context of a deployment sized ahead
(llama-server ``-np 8 -c 32768``, pdserve's decode 2,048 blocks of 16) instead of just what the
load needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import write_results

REPO = Path(__file__).resolve().parent.parent


def cpu_flags() -> list[str]:
    """The CPU's vector flags that matter to both engines."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
    flags = next(
        (line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("flags")), [],
    )  # fmt: skip
    return [flag for flag in wanted if flag in flags]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            # NOTE: llama-server answers with no model while it is still loading one.
            if served_model(url):
                return
        except (OSError, IndexError, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready in {timeout_s} s")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def start_llama(args: argparse.Namespace, gguf: Path, concurrency: int, log: Path) -> tuple[
    subprocess.Popen[bytes], str, list[str]
]:  # fmt: skip
    port = free_port()
    context = peer_context(args, concurrency)
    argv = [str(args.llama_server), "-m", str(gguf), "-np", str(concurrency), "-c", str(context),
            "-t", str(args.llama_threads), "--jinja", "--host", "127.0.0.1",
            "--port", str(port)]  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(args.llama_server).parent)}
    process = subprocess.Popen(
        argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    return process, f"http://127.0.0.1:{port}", argv


def peer_context(args: argparse.Namespace, concurrency: int) -> int:
    """llama-server's ``-c``: the context its slots share (``--context``, or enough for each
    client's request)."""
    return args.context or concurrency * (args.isl + args.osl + 128)


def start_pdserve(args: argparse.Namespace, concurrency: int, log: Path) -> tuple[
    subprocess.Popen[bytes], str, list[str]
]:  # fmt: skip
    port = free_port()
    # NOTE: the decode's KV holds as many tokens as the peer's context (16-token blocks); the
    # prefill's is left at its default, as a user would.
    kv = [f"--decode-args=--num-blocks {-(-peer_context(args, concurrency) // 16)}"]
    argv = [sys.executable, "-m", "pdserve.launcher", "up", "--port", str(port),
            "--grpc-port", "0", *(kv if args.match_kv else []),
            *shlex.split(args.pdserve_args)]  # fmt: skip
    process = subprocess.Popen(
        argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    return process, f"http://127.0.0.1:{port}", argv


def process_parents() -> dict[int, int]:
    """Every running process's parent, from ``/proc/<pid>/stat``."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # NOTE: the command may hold spaces and parentheses; the fields follow the last ")".
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # NOTE: a process that exited meanwhile
    return parents


def pss_mb(pid: int) -> float:
    """A process's proportional memory (PSS) from ``smaps_rollup``; 0 once it is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0.0
    lines = rollup.splitlines()
    return next((int(line.split()[1]) for line in lines if line.startswith("Pss:")), 0) / 1024


def shm_outside_pss_mb(pids: set[int]) -> float:
    """The memory of the shared-memory files (``/dev/shm``) the processes map that no PSS
    counts: each file's allocated pages less the PSS its mappings hold. A decode's KV segment
    is allocated whole at start (``posix_fallocate``) and its pages enter a process's PSS only
    once it touches them; the memory is taken either way."""
    counted: dict[str, float] = {}  # file -> the PSS of its mappings, MB
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
        except OSError:
            continue
        current = None
        for line in lines:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header
                current = parts[5] if len(parts) > 5 and parts[5].startswith("/dev/shm/") else None
            elif current is not None and parts[:1] == ["Pss:"]:
                counted[current] = counted.get(current, 0.0) + int(parts[1]) / 1024
    outside = 0.0
    for path, pss in counted.items():
        try:
            allocated = os.stat(path).st_blocks * 512 / (1 << 20)
        except OSError:  # removed since (its pages go with the last mapping)
            continue
        outside += max(0.0, allocated - pss)
    return outside


def tree_pss_mb(root: int) -> float:
    """The proportional memory (PSS) of a process and all its descendants (pdserve's launcher,
    gateway, prefill and decode, which run in sessions of their own), from ``smaps_rollup``,
    with the pages of their shared-memory files that none of them has touched yet
    (`shm_outside_pss_mb`)."""
    parents = process_parents()
    tree = {root}
    while True:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        if not children:
            break
        tree |= children
    return sum(pss_mb(pid) for pid in tree) + shm_outside_pss_mb(tree)


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as reply:
        return str(json.load(reply)["data"][0]["id"])


def run_aiperf(
    args: argparse.Namespace, url: str, tokenizer: Path, concurrency: int, out_dir: Path
) -> dict[str, Any]:
    argv = [str(args.aiperf), "profile", "--url", url, "--model", served_model(url),
            "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tokenizer),
            "--isl", str(args.isl), "--osl", str(args.osl), "--concurrency", str(concurrency),
            "--num-requests", str(concurrency * args.requests_per_client),
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"max_tokens:{args.osl}",
            "--random-seed", "7", "--artifact-dir", str(out_dir), "--no-gpu-telemetry",
            "--no-server-metrics", "--ui-type", "none"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    export = next(out_dir.rglob("profile_export_aiperf.json"))
    data = json.loads(export.read_text())
    return {
        "output_tok_s": data["output_token_throughput"]["avg"],
        "ttft_p50_ms": data["time_to_first_token"]["p50"],
        "itl_p50_ms": data["inter_token_latency"]["p50"],
        "itl_p99_ms": data["inter_token_latency"]["p99"],
        "num_requests": data["request_count"]["avg"],
        "errors": data.get("error_request_count", {}).get("avg", 0),
    }


def measure(args: argparse.Namespace, gguf: Path, tokenizer: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="peer-"))
    for concurrency in args.concurrency:
        for server in ("llama.cpp", args.label):
            log = work / f"{server}-{concurrency}.log"
            if server == "llama.cpp":
                process, url, argv = start_llama(args, gguf, concurrency, log)
            else:
                process, url, argv = start_pdserve(args, concurrency, log)
            try:
                wait_ready(url, process)
                row = run_aiperf(
                    args, url, tokenizer, concurrency, work / f"{server}-{concurrency}"
                )
                time.sleep(args.idle_s)
                row["pss_mb"] = tree_pss_mb(process.pid)
            finally:
                stop(process)
            row["argv"] = argv
            results[f"{server}@{concurrency}"] = row
            print(f"{server:<12} c={concurrency:<3} {row['output_tok_s']:7.1f} tok/s  "
                  f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms  ITL p50 {row['itl_p50_ms']:6.1f} ms  "
                  f"PSS {row['pss_mb']:6.0f} MB  errors {row['errors']:.0f}",
                  flush=True)  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--aiperf", type=Path, required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--isl", type=int, default=256)
    parser.add_argument("--osl", type=int, default=128)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--llama-threads", type=int, default=1)
    parser.add_argument("--pdserve-args", default="", help="more `pdserve up` flags")
    parser.add_argument("--label", default="pdserve", help="the pdserve row's name")
    parser.add_argument(
        "--idle-s",
        type=float,
        default=3.0,
        help="seconds each server sits idle after its load before its memory is read",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        help="llama-server's -c (and so pdserve's decode KV) at every concurrency; default: "
        "each client's ISL + OSL + 128 tokens",
    )
    parser.add_argument(
        "--match-kv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="size the decode's KV to the peer's context (-c) for the memory comparison",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "shared" / "src"))
    from pdserve.engine.model_store import DEFAULT_MODEL, KNOWN_MODELS, resolve_model

    resolved = resolve_model(DEFAULT_MODEL)
    gguf = resolved.path.parent / Path(KNOWN_MODELS[DEFAULT_MODEL].member).name
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags())}")
    print(f"model: {gguf.name}; ISL {args.isl}, OSL {args.osl}, streaming chat, ignore_eos")
    results = measure(args, gguf, resolved.path)
    print(f"\n{'clients':<9}{'tok/s ratio':>12}{'ITL p50 ratio':>15}{'TTFT p50 ratio':>16}"
          f"{'PSS ratio':>11}")  # fmt: skip
    for concurrency in args.concurrency:
        ours, peer = results[f"{args.label}@{concurrency}"], results[f"llama.cpp@{concurrency}"]
        print(f"{concurrency:<9}{ours['output_tok_s'] / peer['output_tok_s']:>11.2f}x"
              f"{ours['itl_p50_ms'] / peer['itl_p50_ms']:>14.2f}x"
              f"{ours['ttft_p50_ms'] / peer['ttft_p50_ms']:>15.2f}x"
              f"{ours['pss_mb'] / peer['pss_mb']:>10.2f}x")  # fmt: skip
    summary = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "isl": args.isl, "osl": args.osl,
               "label": args.label, "context": args.context, "idle_s": args.idle_s,
               "results": results}  # fmt: skip
    print(f"results: {write_results('peer-llamacpp', summary)}")


if __name__ == "__main__":
    main()
