"""Resumable requests: resume latency through another gateway, and what resumability costs a
request that never needs it.

Starts etcd, two gateways sharing it, one prefill and one decode (processes, the launcher,
``--insecure``) on the default model (SmolLM2-135M-Instruct; ``--demo`` for the tiny demo
model), then:

* **Resume latency.** ``--resumes`` times: a background streamed response is created on
  gateway 0 and read until its ``--resume-after``-th text delta; the client leaves, and
  resumes through gateway 1 (``GET /v1/responses/{id}?stream=true&starting_after=N``), which
  takes the response over from etcd and the decode. Measured: from sending the resume to its
  first event (the client resumes from two events before the last it read, as one whose last
  events were lost on the way: the first event it gets is a replayed one, not the next
  token). Against it, the time to first event of a new streamed response of the same prompt
  on gateway 1, taken in the same loop.
* **Normal-path cost.** ``--requests`` streamed responses on gateway 0, ``--rounds`` rounds
  rotating plain (``store: false``: stateless), stored (the default: its record written to etcd
  as it ends) and ``background: true`` (resumable: one delta per token, the record in etcd, the
  decode keeping the stream): gateway 0's CPU seconds per request (from /proc) and the records
  it wrote per request (``pdserve_gateway_resume_store_writes_total``).
* **A continuation.** ``--turns`` times: a stored response on gateway 0, then its next turn
  through gateway 1, alternately by ``previous_response_id`` (the earlier turn read from etcd
  and its output made again from its tokens) and sent whole (``store: false``), each the
  time to its whole (non-streamed) answer of ``--turn-tokens`` tokens.

    .venv/bin/python bench/resume.py [--resumes 50] [--requests 32] [--rounds 4] [--turns 20]
        [--demo] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from common import percentile, write_results

from pdserve.launcher.cluster import Cluster
from pdserve.launcher.config import ClusterConfig

PROMPT = "Explain how a serving system moves a request between machines " * 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_etcd(workdir: Path) -> Iterator[str]:
    """A single-member etcd on loopback; yields its ``etcd://`` spec."""
    binary = shutil.which("etcd")
    if binary is None:
        sys.exit("etcd is not installed (make system-deps, or apt-get install -y etcd-server)")
    client, peer = f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"
    with open(workdir / "etcd.log", "ab") as log:
        process = subprocess.Popen(
            [binary, "--name", "bench", "--data-dir", str(workdir / "etcd-data"),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"bench={peer}", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=0.5) as answer:
                    if json.loads(answer.read()).get("health") == "true":
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                sys.exit("etcd did not start")
            time.sleep(0.05)
        yield "etcd://" + client.removeprefix("http://")
    finally:
        process.terminate()
        process.wait(10)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


KINDS = ("plain", "stored", "resumable")


def _body(model: str, max_tokens: int, kind: str, seed: int) -> dict[str, Any]:
    """A streamed response of `kind` (``plain``: not stored, ``stored``, ``resumable``: in the
    background)."""
    return {
        "model": model,
        "input": PROMPT,
        "max_output_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
        "background": kind == "resumable",
        "store": kind != "plain",
    }


async def _events(response: httpx.Response) -> Any:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield json.loads(line.removeprefix("data: "))


async def _first_event_s(http: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> float:
    """Seconds from sending a request to its first server-sent event (the rest is read)."""
    started = time.perf_counter()
    first: float | None = None
    async with http.stream(method, url, **kwargs) as response:
        response.raise_for_status()
        async for _ in _events(response):
            if first is None:
                first = time.perf_counter() - started
    assert first is not None
    return first


async def measure_resumes(
    http: httpx.AsyncClient, urls: list[str], model: str, args: argparse.Namespace
) -> dict[str, Any]:
    resume_s: list[float] = []
    ttft_s: list[float] = []
    for index in range(args.resumes):
        body = _body(model, args.max_tokens, "resumable", seed=index)
        delta_numbers: list[int] = []
        response_id = ""
        async with http.stream("POST", f"{urls[0]}/v1/responses", json=body) as created:
            created.raise_for_status()
            async for event in _events(created):
                response_id = event.get("response", {}).get("id", response_id)
                if event["type"] == "response.output_text.delta":
                    delta_numbers.append(event["sequence_number"])
                if len(delta_numbers) >= args.resume_after:
                    break  # NOTE: the client leaves; the response runs on
        # NOTE: the client lost its last two events on the way: the resume replays them.
        last = delta_numbers[-3]
        url = f"{urls[1]}/v1/responses/{response_id}"
        params = {"stream": "true", "starting_after": str(last)}
        resume_s.append(await _first_event_s(http, "GET", url, params=params))
        new = _body(model, args.max_tokens, "plain", seed=index)
        ttft_s.append(await _first_event_s(http, "POST", f"{urls[1]}/v1/responses", json=new))
    summary = {
        f"{name}_p{q}_ms": round(1000 * percentile(values, q), 2)
        for name, values in (("resume", resume_s), ("ttft", ttft_s))
        for q in (50, 99)
    }
    for q in (50, 99):
        summary[f"resume_over_ttft_p{q}"] = round(
            summary[f"resume_p{q}_ms"] / summary[f"ttft_p{q}_ms"], 3
        )
    return summary


async def _store_writes(http: httpx.AsyncClient, url: str) -> float:
    text = (await http.get(f"{url}/metrics")).text
    name = "pdserve_gateway_resume_store_writes_total"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


async def measure_cost(
    http: httpx.AsyncClient, url: str, model: str, pid: int, args: argparse.Namespace
) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}

    async def one(kind: str, seed: int) -> None:
        body = _body(model, args.max_tokens, kind, seed)
        async with http.stream("POST", f"{url}/v1/responses", json=body) as response:
            response.raise_for_status()
            async for _ in _events(response):
                pass

    for index in range(args.rounds):
        order = KINDS[index % 3 :] + KINDS[: index % 3]
        for name in order:
            writes_before, cpu_before = await _store_writes(http, url), cpu_s(pid)
            for start in range(0, args.requests, args.concurrency):
                batch = range(start, min(start + args.concurrency, args.requests))
                await asyncio.gather(*(one(name, seed) for seed in batch))
            await asyncio.sleep(0.5)  # NOTE: the round's last end records land in it
            cpu = cpu_s(pid) - cpu_before
            writes = await _store_writes(http, url) - writes_before
            rounds[name].append(
                {
                    "gateway_cpu_ms_per_request": 1000 * cpu / args.requests,
                    "store_writes_per_request": writes / args.requests,
                }
            )
    summary: dict[str, Any] = {}
    for name, values in rounds.items():
        for key in values[0]:
            summary[f"{name}_{key}"] = round(statistics.median(v[key] for v in values), 3)
    for name in ("stored", "resumable"):
        summary[f"cpu_ratio_{name}_over_plain"] = round(
            summary[f"{name}_gateway_cpu_ms_per_request"]
            / summary["plain_gateway_cpu_ms_per_request"],
            3,
        )
    summary["rounds"] = rounds
    return summary


async def measure_continuations(
    http: httpx.AsyncClient, urls: list[str], model: str, args: argparse.Namespace
) -> dict[str, Any]:
    times: dict[str, list[float]] = {"continued": [], "whole": []}
    for index in range(args.turns):
        first = {"model": model, "input": f"{index}: {PROMPT}", "max_output_tokens": 16,
                 "temperature": 0.0}  # fmt: skip
        answer = (await http.post(f"{urls[0]}/v1/responses", json=first)).json()
        turn = {"model": model, "max_output_tokens": args.turn_tokens, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        continued = {**turn, "input": "And then?", "previous_response_id": answer["id"]}
        whole = {
            **turn,
            "store": False,
            "input": [{"role": "user", "content": first["input"]}, *answer["output"],
                      {"role": "user", "content": "And then?"}],
        }  # fmt: skip
        order = (("continued", continued), ("whole", whole))
        for name, body in order if index % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            response = await http.post(f"{urls[1]}/v1/responses", json=body)
            response.raise_for_status()
            times[name].append(time.perf_counter() - started)
    summary: dict[str, Any] = {
        f"{name}_p50_ms": round(1000 * statistics.median(values), 2)
        for name, values in times.items()
    }
    summary["continued_over_whole_p50"] = round(
        summary["continued_p50_ms"] / summary["whole_p50_ms"], 3
    )
    return summary


async def measure(cluster: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    urls = cluster.rest_urls
    decode = next(e for e in cluster.decodes[0].events if e.get("event") == "decode_started")
    model = str(decode["model"])
    async with httpx.AsyncClient(timeout=120) as http:
        for url in urls:  # NOTE: warm both gateways (tokenizer, channels)
            await _first_event_s(
                http, "POST", f"{url}/v1/responses", json=_body(model, 4, "plain", 0)
            )
        resumes = await measure_resumes(http, urls, model, args)
        await asyncio.sleep(2.0)  # NOTE: the last responses' end records are written meanwhile
        gateway_pid = cluster.gateways[0].pid
        cost = await measure_cost(http, urls[0], model, gateway_pid, args)
        continuations = await measure_continuations(http, urls, model, args)
    return {"resume": resumes, "cost": cost, "continuation": continuations}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resumes", type=int, default=50)
    parser.add_argument("--resume-after", type=int, default=4, help="text deltas read first")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--turns", type=int, default=20, help="continuations timed, each way")
    parser.add_argument("--turn-tokens", type=int, default=8, help="tokens of a continuation")
    parser.add_argument("--demo", action="store_true", help="the tiny demo model instead")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser.parse_args()


def main() -> None:
    from pdserve.engine.demo import ensure_demo_model
    from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model

    args = parse_args()
    model_dir = ensure_demo_model() if args.demo else resolve_model(DEFAULT_MODEL).path
    with tempfile.TemporaryDirectory() as tmp, running_etcd(Path(tmp)) as registry:
        config = ClusterConfig(
            model=str(model_dir), port=0, grpc_port=0, internal_port=0,
            insecure=True, log_dir=str(Path(tmp) / "logs"), gateways=2, registry=registry,
        )  # fmt: skip
        cluster = Cluster(config, env={**os.environ, "OMP_NUM_THREADS": "1"})
        cluster.start()
        try:
            results = asyncio.run(measure(cluster, args))
        finally:
            cluster.stop()
    record = {
        "cpu_count": os.cpu_count(),
        "model": model_dir.name,
        "settings": vars(args),
        **results,
    }
    path = write_results("resume", record)
    if args.json:
        print(json.dumps(record, indent=2))
        return
    resume, cost = results["resume"], results["cost"]
    print(f"{'':<34}{'p50':>10}{'p99':>10}")
    for name in ("resume", "ttft"):
        print(f"{name + ' (ms)':<34}{resume[f'{name}_p50_ms']:>10}{resume[f'{name}_p99_ms']:>10}")
    print(
        f"{'resume / ttft':<34}{resume['resume_over_ttft_p50']:>10}"
        f"{resume['resume_over_ttft_p99']:>10}"
    )
    print()
    print(f"{'':<34}" + "".join(f"{kind:>11}" for kind in KINDS))
    for key in ("gateway_cpu_ms_per_request", "store_writes_per_request"):
        print(f"{key:<34}" + "".join(f"{cost[f'{kind}_{key}']:>11}" for kind in KINDS))
    for name in ("stored", "resumable"):
        print(f"CPU ratio ({name} / plain): {cost[f'cpu_ratio_{name}_over_plain']}")
    turns = results["continuation"]
    print(
        f"a turn by previous_response_id / sent whole, p50: {turns['continued_p50_ms']} / "
        f"{turns['whole_p50_ms']} ms ({turns['continued_over_whole_p50']}x)"
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
