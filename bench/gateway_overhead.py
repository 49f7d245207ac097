"""Gateway added latency: the same requests through the gateway and straight to the instances.

Starts a cluster (gateway + 1 prefill + 1 decode as processes, the launcher, internal plane in
plaintext: ``--insecure``) on a small model, so the model's own time is small, and drives
``--streams`` concurrent streams two ways, interleaved round by round (the order alternates):

* ``gateway``: GenerationService.Generate on the gateway's public gRPC port, prompt as text (the
  gateway tokenizes, detokenizes, routes and relays: all of that is gateway cost);
* ``direct``: what the gateway does, done by the load generator itself: prompt tokenized up
  front, PrefillService.Prefill with a DecodeTarget (the first token arrives on it), then, after
  the prefill stream ends with HandedOff, DecodeService.Generate on the lease.

Both paths send the same token ids with the same sampling (greedy, ``ignore_eos``, a fixed
``max_tokens``), so every request produces exactly ``--output-len`` tokens. Per request: TTFT
(send to the first token) and ITL (gap between token-carrying messages, split evenly over the
tokens a message carries). Per round and path: p50/p99 of each, and the gateway process's CPU
time per request (read from /proc: steadier than latencies on a busy machine, and on a small
machine the gateway's CPU is taken from the engines). The added latency is gateway minus direct,
per round; the table quotes medians over rounds (other processes share this
machine's cores: a single round is noise).

    .venv/bin/python bench/gateway_overhead.py [--streams 64] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from common import percentile, write_results

from pdserve.common.generation import SamplingParams
from pdserve.launcher.cluster import Cluster
from pdserve.launcher.config import ClusterConfig
from pdserve.serving.convert import local_protocol, sampling_to_proto
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

PATHS = ("gateway", "direct")
METRICS = ("ttft", "itl", "e2e")
QUANTILES = (50, 99)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "box")


@dataclass
class Sample:
    """One request's timings (seconds)."""

    ttft_s: float = float("nan")
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = float("nan")
    num_tokens: int = 0


class Timer:
    """Records TTFT and ITL from token-carrying messages as they arrive."""

    def __init__(self) -> None:
        self.sample = Sample()
        self._started = time.perf_counter()
        self._last: float | None = None

    def tokens(self, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self.sample.ttft_s = now - self._started
        else:
            self.sample.itl_s += [(now - self._last) / num_tokens] * num_tokens
        self._last = now
        self.sample.num_tokens += num_tokens

    def done(self) -> Sample:
        self.sample.e2e_s = time.perf_counter() - self._started
        return self.sample


@dataclass(frozen=True)
class Target:
    """Where the two paths send requests."""

    gateway: generation_pb2_grpc.GenerationServiceStub
    prefill: prefill_pb2_grpc.PrefillServiceStub
    decode: decode_pb2_grpc.DecodeServiceStub
    decode_address: str
    decode_instance_id: str
    model: str


async def via_gateway(target: Target, text: str, token_ids: list[int], max_tokens: int) -> Sample:
    request = generation_pb2.GenerateRequest(
        model=target.model,
        text=text,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    timer = Timer()
    async for message in target.gateway.Generate(request, timeout=300):
        timer.tokens(len(message.token_ids))
    return timer.done()


async def direct(target: Target, text: str, token_ids: list[int], max_tokens: int) -> Sample:
    sampling = SamplingParams(temperature=0.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    request_id = uuid.uuid4().hex
    request = prefill_pb2.PrefillRequest(
        request_id=request_id,
        token_ids=token_ids,
        num_prompt_tokens=len(token_ids),
        sampling=sampling_to_proto(sampling),
        decode=prefill_pb2.DecodeTarget(
            address=target.decode_address, instance_id=target.decode_instance_id
        ),
        protocol=local_protocol(),
    )
    timer = Timer()
    lease_id = ""
    async for message in target.prefill.Prefill(request, timeout=300):
        kind = message.WhichOneof("event")
        if kind == "first_token":
            timer.tokens(1)
        elif kind == "handed_off":
            lease_id = message.handed_off.lease_id
    if not lease_id:
        raise RuntimeError("the prefill stream ended without HandedOff")
    generate = decode_pb2.DecodeServiceGenerateRequest(request_id=request_id, lease_id=lease_id)
    async for message in target.decode.Generate(generate, timeout=300):
        if message.WhichOneof("event") == "tokens":
            timer.tokens(len(message.tokens.token_ids))
    return timer.done()


Send = Callable[[Target, str, list[int], int], Awaitable[Sample]]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_round(
    send: Send, target: Target, prompts: list[tuple[str, list[int]]], streams: int, out_len: int
) -> tuple[list[Sample], float]:
    """Closed loop: `streams` workers send `prompts` in order; returns samples and duration."""
    queue = list(reversed(prompts))
    samples: list[Sample] = []

    async def worker() -> None:
        while queue:
            text, token_ids = queue.pop()
            samples.append(await send(target, text, token_ids, out_len))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    return samples, time.perf_counter() - started


def summarize(
    samples: list[Sample], duration_s: float, out_len: int, gateway_cpu_s: float
) -> dict[str, float]:
    values = {
        "ttft": [s.ttft_s for s in samples],
        "itl": [v for s in samples for v in s.itl_s],
        "e2e": [s.e2e_s for s in samples],
    }
    summary = {
        f"{metric}_p{q}_ms": round(1000 * percentile(values[metric], q), 3)
        for metric in METRICS
        for q in QUANTILES
    }
    summary["output_tokens_per_s"] = round(sum(s.num_tokens for s in samples) / duration_s, 1)
    summary["gateway_cpu_ms_per_request"] = round(1000 * gateway_cpu_s / len(samples), 3)
    summary["num_short"] = sum(s.num_tokens != out_len for s in samples)
    return summary


def make_prompts(tokenizer: Tokenizer, num: int, prompt_len: int) -> list[tuple[str, list[int]]]:
    """Distinct prompts of random words, each `prompt_len` characters, tokenized up front."""
    rng = random.Random(0)
    prompts = []
    for i in range(num):
        text = f"{i} " + " ".join(rng.choice(WORDS) for _ in range(prompt_len))
        text = text[:prompt_len]
        prompts.append((text, tokenizer.encode(text)))
    return prompts


def start_cluster(args: argparse.Namespace, log_dir: Path) -> tuple[Cluster, Path]:
    from pdserve.engine.demo import ensure_demo_model

    model_dir = Path(args.model_dir) if args.model_dir else ensure_demo_model()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    config = ClusterConfig(
        model=str(model_dir), port=0, grpc_port=0, internal_port=0, insecure=True,
        log_dir=str(log_dir), decode_args=args.decode_args,
    )  # fmt: skip
    cluster = Cluster(config, env=env)
    cluster.start()
    return cluster, model_dir


def event_of(cluster: Cluster, name: str) -> dict[str, Any]:
    children = cluster.prefills if name == "prefill_started" else cluster.decodes
    return next(e for e in children[0].events if e.get("event") == name)


async def measure(args: argparse.Namespace, cluster: Cluster, model_dir: Path) -> dict[str, Any]:
    tokenizer = Tokenizer.from_pretrained(model_dir)
    assert cluster.gateway is not None
    gateway_pid = cluster.gateway.pid
    prefill, decode = event_of(cluster, "prefill_started"), event_of(cluster, "decode_started")
    channels = [grpc.aio.insecure_channel(a) for a in (cluster.grpc_address, prefill["address"])]
    channels.append(grpc.aio.insecure_channel(decode["address"]))
    target = Target(
        gateway=generation_pb2_grpc.GenerationServiceStub(channels[0]),
        prefill=prefill_pb2_grpc.PrefillServiceStub(channels[1]),
        decode=decode_pb2_grpc.DecodeServiceStub(channels[2]),
        decode_address=decode["address"],
        decode_instance_id=decode["instance_id"],
        model=decode["model"],
    )
    sends: dict[str, Send] = {"gateway": via_gateway, "direct": direct}
    warmup = make_prompts(tokenizer, args.streams, args.prompt_len)
    for name in PATHS:
        await run_round(sends[name], target, warmup, args.streams, args.output_len)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in PATHS}
    for index in range(args.rounds):
        prompts = make_prompts(tokenizer, args.requests, args.prompt_len)
        # NOTE: alternate which path goes first, so drift on a shared machine hits both.
        for name in PATHS if index % 2 == 0 else tuple(reversed(PATHS)):
            cpu_before = cpu_s(gateway_pid)
            samples, duration_s = await run_round(
                sends[name], target, prompts, args.streams, args.output_len
            )
            gateway_cpu_s = cpu_s(gateway_pid) - cpu_before
            rounds[name].append(summarize(samples, duration_s, args.output_len, gateway_cpu_s))
        added = {
            key: round(rounds["gateway"][-1][key] - rounds["direct"][-1][key], 3)
            for key in rounds["gateway"][-1]
            if key.endswith("_ms")
        }
        print(f"round {index + 1}: added {json.dumps(added)}", file=sys.stderr, flush=True)
    for channel in channels:
        await channel.close()
    medians = {
        name: {key: statistics.median(r[key] for r in rounds[name]) for key in rounds[name][0]}
        for name in PATHS
    }
    added = {
        key: round(
            statistics.median(
                g[key] - d[key] for g, d in zip(rounds["gateway"], rounds["direct"], strict=True)
            ),
            3,
        )
        for key in medians["gateway"]
        if key.endswith("_ms")
    }
    return {"medians": medians, "added_ms": added, "rounds": rounds}


def print_table(results: dict[str, Any], streams: int) -> None:
    medians, added = results["medians"], results["added_ms"]
    print(f"{'metric':<22}{'gateway':>12}{'direct':>12}{'added':>12}{'ratio':>8}")
    for metric in METRICS:
        for q in QUANTILES:
            key = f"{metric}_p{q}_ms"
            gateway, direct_ms = medians["gateway"][key], medians["direct"][key]
            ratio = f"{gateway / direct_ms:>8.2f}" if direct_ms else f"{'-':>8}"
            title = f"{metric.upper()} p{q} (ms)"
            print(f"{title:<22}{gateway:>12.3f}{direct_ms:>12.3f}{added[key]:>12.3f}{ratio}")
    key = "output_tokens_per_s"
    gateway, direct_tps = medians["gateway"][key], medians["direct"][key]
    ratio = gateway / direct_tps
    print(f"{'output tok/s':<22}{gateway:>12.1f}{direct_tps:>12.1f}{'':>12}{ratio:>8.2f}")
    key = "gateway_cpu_ms_per_request"
    gateway, direct_cpu = medians["gateway"][key], medians["direct"][key]
    print(f"{'gateway CPU/req (ms)':<22}{gateway:>12.3f}{direct_cpu:>12.3f}")
    goal_p50 = added["ttft_p50_ms"] <= 1 and added["itl_p50_ms"] <= 1
    goal_p99 = added["ttft_p99_ms"] <= 5 and added["itl_p99_ms"] <= 5
    print(
        f"goal at {streams} streams: added p50 <= 1 ms {'met' if goal_p50 else 'NOT met'}, "
        f"added p99 <= 5 ms {'met' if goal_p99 else 'NOT met'} (TTFT and ITL; medians over rounds)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams per path")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (each runs both paths)")
    parser.add_argument("--requests", type=int, default=192, help="requests per round and path")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt characters")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per completion")
    parser.add_argument("--model-dir", help="model to serve (default: the built-in demo model)")
    parser.add_argument(
        "--decode-args", default="--num-blocks 1024", help="extra flags for the decode"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-gwlat-") as log_dir:
        cluster, model_dir = start_cluster(args, Path(log_dir))
        try:
            results = asyncio.run(measure(args, cluster, model_dir))
        finally:
            cluster.stop(timeout_s=20)
    print_table(results, args.streams)
    settings = {key: value for key, value in vars(args).items() if key != "json"}
    record = {"command": " ".join(sys.argv[1:]), "settings": settings, "internal_plane": "insecure"}
    record |= {"model": model_dir.name, "cpu_count": os.cpu_count(), **results}
    path = write_results("gateway_overhead", record)
    print(f"results: {path.name}")
    if args.json:
        print(json.dumps(record))


if __name__ == "__main__":
    main()
