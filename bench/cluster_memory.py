"""The memory and start-up of `pdserve up`, its services forked from the fork server or each
started as its own python (``--no-fork-server``), in one run.

    python bench/cluster_memory.py --rounds 3

Each round starts `pdserve up` on the default model once each way (alternating, fresh each
time), times its start (the command until the gateway lists the model), sends one chat
completion, then reads the proportional memory (PSS, ``/proc/<pid>/smaps_rollup``) of every
process it started: the launcher, the fork server, the gateway, the prefill and the decode. The
decode's KV holds 512 tokens (``--num-blocks 32``, what `bench/peer_llamacpp.py` gives it at one
client; KV is not what this compares). The table gives each process's median PSS both ways, the
totals and their ratio; the CPU flags and every round go to
bench/results/cluster-memory-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import write_results
from peer_llamacpp import cpu_flags, cpu_model, free_port, process_parents, pss_mb, served_model

SETTINGS = {"forked": [], "own python": ["--no-fork-server"]}
ROLES = ("launcher", "fork server", "gateway", "prefill-0", "decode-0")


def chat(url: str) -> None:
    body = {
        "model": served_model(url),
        "messages": [{"role": "user", "content": "Tell me about Paris."}],
        "max_tokens": 32,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        reply.read()


def one_round(setting: str, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.launcher", "up", "--port", str(port),
            "--grpc-port", "0", "--decode-args=--num-blocks 32", *SETTINGS[setting]]  # fmt: skip
    log = log_dir / f"up-{setting.replace(' ', '-')}-{time.time_ns()}.log"
    started = time.monotonic()
    process = subprocess.Popen(
        argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"pdserve up exited: {log.read_text()[-2000:]}")
            try:
                served_model(url)
                break
            except (OSError, IndexError):  # NOTE: up, but no model registered yet
                time.sleep(0.2)
        startup_s = time.monotonic() - started
        chat(url)
        match = re.search(
            r"Processes: gateway (\d+), prefill-0 (\d+), decode-0 (\d+)", log.read_text()
        )
        assert match is not None, "no Processes line in the banner"
        pids = {"launcher": process.pid, "gateway": int(match[1]), "prefill-0": int(match[2]),
                "decode-0": int(match[3])}  # fmt: skip
        children = [pid for pid, parent in process_parents().items() if parent == process.pid]
        others = [pid for pid in children if pid not in pids.values()]
        memory = {role: pss_mb(pid) for role, pid in pids.items()}
        memory["fork server"] = sum(pss_mb(pid) for pid in others)
        return {"setting": setting, "startup_s": startup_s, "pss_mb": memory,
                "total_mb": sum(memory.values())}  # fmt: skip
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}; flags: {' '.join(cpu_flags())}")
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cluster-memory-") as work:
        for index in range(args.rounds):
            for setting in SETTINGS if index % 2 == 0 else reversed(SETTINGS):
                row = one_round(setting, Path(work))
                rounds.append(row)
                print(f"round {index + 1} {setting:>10}: start {row['startup_s']:5.1f} s, "
                      f"PSS {row['total_mb']:6.0f} MB", flush=True)  # fmt: skip

    def median(setting: str, key: str, role: str | None = None) -> float:
        rows = [row for row in rounds if row["setting"] == setting]
        return statistics.median(row[key][role] if role else row[key] for row in rows)

    print("\n| process | PSS forked (MB) | PSS own python (MB) |\n|---|---:|---:|")
    for role in ROLES:
        print(f"| {role} | {median('forked', 'pss_mb', role):.0f} | "
              f"{median('own python', 'pss_mb', role):.0f} |")  # fmt: skip
    forked, own = median("forked", "total_mb"), median("own python", "total_mb")
    print(f"| **all** | **{forked:.0f}** | **{own:.0f}** |")
    start_forked, start_own = median("forked", "startup_s"), median("own python", "startup_s")
    ratio = start_forked / start_own
    print(f"\nPSS forked / own python: {forked / own:.2f}x; "
          f"start-up {start_forked:.1f} / {start_own:.1f} s ({ratio:.2f}x)")  # fmt: skip
    path = write_results(
        "cluster-memory",
        {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "rounds": rounds,
         "pss_ratio": forked / own, "startup_ratio": start_forked / start_own},
    )  # fmt: skip
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
