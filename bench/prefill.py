"""Prefill service vs the colocated LLMEngine, and isolation from a slow decode, in one run.

1. TTFT at a fixed arrival rate. The same requests (random prompts, Poisson arrivals with a
   fixed seed) go to (a) a `pdserve-prefill` process handing off to a `pdserve-decode` process,
   timed from the arrival to the `first_token` event, and (b) `LLMEngine` serving them
   colocated in its step loop (its own process), timed to the step that produced each first
   token. Every request is decoded to `max_tokens` on both sides; both use the same token
   budget per pass. Short rounds alternate the sides; p50/p90 over all rounds. Every process
   is pinned to one CPU (so one torch thread each), in two layouts:
   * one_core: prefill, decode and the engine all on CPU 0 (the same total hardware).
   * own_cores: prefill on CPU 0, decode on CPU 1, the engine on CPU 0 (the prefill instance
     has the colocated engine's hardware, as when prefill and decode are separate machines).
2. Isolation. One prefill, two decodes; 32 requests sent at once, every fourth aimed at a
   decode whose AllocateBlocks answers only after a delay. Prefill throughput (prompt tokens
   per second until the last HandedOff) as a ratio to the same requests all aimed at the
   healthy decode (target >= 0.95): a prefill that waited on the slow decode's leases would
   idle. Also reported: the healthy decode's requests alone vs with the slow ones in the mix.
   The variants take turns on the same servers (5 rounds); ratios are medians of per-round
   ratios.
3. Overlap and chunk size. Time from `first_token` to `HandedOff` (the part of the KV transfer
   that layer-wise pushing leaves after the last layer) for one long prompt at several
   --max-chunk-bytes, next to the time the same KV takes as one stream sent after compute.

    .venv/bin/python bench/prefill.py [--quick] [--max-tokens N] [--parts ...] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import torch
from common import build_random_llama, percentile, write_results

from pdserve.common.generation import SamplingParams, num_blocks_for
from pdserve.common.grpc_server import insecure_channel
from pdserve.common.logging import configure_logging
from pdserve.decode import server as decode_server
from pdserve.decode.config import DecodeConfig
from pdserve.engine.colocated import LLMEngine
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.kv.transfer import sequence_pieces
from pdserve.prefill import convert
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.kv.sender import KvSender
from pdserve.prefill.request import Request
from pdserve.prefill.server import PrefillInstance, create_server
from pdserve.serving.convert import local_protocol, sampling_to_proto
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

BLOCK_SIZE = 16
BUDGET = 512  # tokens per forward pass, both sides
NUM_BLOCKS = 1024
PROMPT_TOKENS = (32, 256)
# CPUs of the prefill process, the decode process and the engine process, one torch thread each.
LAYOUTS = {"one_core": ("0", "0", "0"), "own_cores": ("0", "1", "0")}


def workload(num: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randint(*lengths))] for _ in range(num)]


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def _message(
    request_id: str, prompt: list[int], sampling: SamplingParams, decode_address: str
) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=request_id,
        token_ids=prompt,
        sampling=sampling_to_proto(sampling),
        decode=prefill_pb2.DecodeTarget(address=decode_address),
        protocol=local_protocol(),
    )


# ---- 1. TTFT -------------------------------------------------------------------------------


def _pinned(argv: list[str], cpus: str) -> list[str]:
    # NOTE: torch sizes its thread pool from the affinity mask, so one CPU means one thread.
    return ["taskset", "-c", cpus, *argv]


class _Service:
    """A `pdserve-<role>` process; its address comes from the `<role>_started` log event."""

    def __init__(self, process: asyncio.subprocess.Process, address: str) -> None:
        self.process = process
        self.address = address
        assert process.stderr is not None
        self._drain = asyncio.create_task(self._read_all(process.stderr))

    @classmethod
    async def start(cls, role: str, args: list[str], cpus: str) -> _Service:
        argv = [sys.executable, "-m", f"pdserve.{role}", "--port", "0", *args]
        process = await asyncio.create_subprocess_exec(
            *_pinned(argv, cpus), stderr=asyncio.subprocess.PIPE
        )
        assert process.stderr is not None
        while line := await asyncio.wait_for(process.stderr.readline(), 120):
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if record.get("event") == f"{role}_started":
                    return cls(process, record["address"])
        raise RuntimeError(f"pdserve-{role} exited before it started")

    @staticmethod
    async def _read_all(stream: asyncio.StreamReader) -> None:
        while await stream.read(1 << 16):
            pass  # keep the pipe from filling up

    async def stop(self) -> None:
        self.process.terminate()
        await self.process.wait()
        await self._drain


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def service_ttft(
    model_dir: Path, prompts: list[list[int]], arrivals: list[float], layout: str, max_tokens: int
) -> list[float]:
    prefill_cpus, decode_cpus, _ = LAYOUTS[layout]
    common = ["--model", str(model_dir), "--block-size", str(BLOCK_SIZE),
              "--num-blocks", str(NUM_BLOCKS), "--log-level", "info"]  # fmt: skip
    decode = await _Service.start("decode", [*common, "--lease-ttl-ms", "600000"], decode_cpus)
    prefill = await _Service.start(
        "prefill", [*common, "--max-num-batched-tokens", str(BUDGET)], prefill_cpus
    )
    channel = insecure_channel(prefill.address)
    stub = prefill_pb2_grpc.PrefillServiceStub(channel)
    decode_channel = insecure_channel(decode.address)
    decode_stub = decode_pb2_grpc.DecodeServiceStub(decode_channel)

    async def one(request_id: str, prompt: list[int], arrival: float) -> float:
        await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        ttft, lease_id = 0.0, ""
        message = _message(request_id, prompt, _greedy(max_tokens), decode.address)
        async for response in stub.Prefill(message):
            if response.WhichOneof("event") == "first_token":
                ttft = time.perf_counter() - arrival
            elif response.WhichOneof("event") == "handed_off":
                lease_id = response.handed_off.lease_id
        request = decode_pb2.DecodeServiceGenerateRequest(lease_id=lease_id)
        async for _ in decode_stub.Generate(request):
            pass
        return ttft

    for i in range(2):  # warm-up: the first passes are slow
        await one(f"warmup-{i}", prompts[i], time.perf_counter())
    start = time.perf_counter() + 0.05
    ttfts = await asyncio.gather(
        *(
            one(f"r{i}", p, start + a)
            for i, (p, a) in enumerate(zip(prompts, arrivals, strict=True))
        )
    )
    await channel.close()
    await decode_channel.close()
    await prefill.stop()
    await decode.stop()
    return list(ttfts)


def engine_ttft(
    model_dir: Path, prompts: list[list[int]], arrivals: list[float], max_tokens: int
) -> list[float]:
    """The colocated baseline (runs in an engine worker process)."""
    sampling = _greedy(max_tokens)
    config = EngineConfig(
        model=str(model_dir),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET),
    )
    engine = LLMEngine(config)
    engine.generate(prompts[:2], sampling)  # warm-up
    ttfts: dict[str, float] = {}
    arrival_of: dict[str, float] = {}
    pending = list(enumerate(zip(prompts, arrivals, strict=True)))
    start = time.perf_counter() + 0.05
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending and start + pending[0][1][1] <= now:
            i, (prompt, arrival) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, sampling)
            arrival_of[f"r{i}"] = start + arrival
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0][1][1] - time.perf_counter()))
            continue
        outputs = engine.step()
        done = time.perf_counter()
        for output in outputs:
            if output.new_token_ids and output.request_id not in ttfts:
                ttfts[output.request_id] = done - arrival_of[output.request_id]
    return [ttfts[f"r{i}"] for i in range(len(prompts))]


def run_engine_worker(
    model_dir: Path, num: int, rate: float, seed: int, layout: str, max_tokens: int
) -> list[float]:
    argv = [sys.executable, __file__, "--engine-worker", "--model-dir", str(model_dir),
            "--num", str(num), "--rate", str(rate), "--seed", str(seed),
            "--max-tokens", str(max_tokens)]  # fmt: skip
    done = subprocess.run(
        _pinned(argv, LAYOUTS[layout][2]), capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def ttft_rows(
    model_dir: Path, num: int, rate: float, rounds: int, max_tokens: int
) -> dict[str, Any]:
    # NOTE: short rounds that alternate side and layout, so that background load on a shared
    # machine falls on both sides alike; the load average before each side is recorded.
    samples: dict[str, dict[str, list[float]]] = {
        layout: {"service": [], "engine": [], "loadavg": []} for layout in LAYOUTS
    }
    for r in range(rounds):
        prompts = workload(num, seed=r, lengths=PROMPT_TOKENS)
        arrivals = poisson_arrivals(num, rate, seed=100 + r)
        for layout, sample in samples.items():
            sample["loadavg"].append(os.getloadavg()[0])
            sample["engine"] += run_engine_worker(model_dir, num, rate, r, layout, max_tokens)
            sample["loadavg"].append(os.getloadavg()[0])
            sample["service"] += asyncio.run(
                service_ttft(model_dir, prompts, arrivals, layout, max_tokens)
            )
    return {
        layout: {
            "num_requests": len(sample["service"]),
            "service_p50_s": percentile(sample["service"], 50),
            "service_p90_s": percentile(sample["service"], 90),
            "engine_p50_s": percentile(sample["engine"], 50),
            "engine_p90_s": percentile(sample["engine"], 90),
            "loadavg_1m": sample["loadavg"],
        }
        for layout, sample in samples.items()
    }


# ---- 2. isolation --------------------------------------------------------------------------


class SlowAllocate(grpc.aio.ServerInterceptor):
    """Answers AllocateBlocks only after `delay_s` (a decode that is slow to grant leases)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        handler = await continuation(details)
        if handler is None or not details.method.endswith("/AllocateBlocks"):
            return handler
        inner = handler.unary_unary

        async def delayed(request, context):  # type: ignore[no-untyped-def]
            await asyncio.sleep(self.delay_s)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            delayed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _host(model_dir: Path) -> ModelHost:
    return ModelHost.load(
        str(model_dir), "bench", num_blocks=NUM_BLOCKS, kv_cache_memory_mb=1,
        block_size=BLOCK_SIZE, dtype="float32", device="cpu", max_model_len=None,
    )  # fmt: skip


async def _decode(model_dir: Path, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):  # type: ignore[no-untyped-def]
    config = DecodeConfig(port=0, block_size=BLOCK_SIZE, lease_ttl_ms=600_000, insecure=True)
    return await decode_server.create_server(config, _host(model_dir), interceptors=interceptors)


async def _prefill(model_dir: Path, **settings: Any) -> PrefillInstance:
    config = PrefillConfig(
        port=0, block_size=BLOCK_SIZE, max_num_batched_tokens=BUDGET,
        allocate_timeout_ms=60_000, insecure=True, **settings,
    )  # fmt: skip
    return await create_server(config, _host(model_dir))


async def isolation_rows(
    model_dir: Path, num: int, slow_delay_s: float, rounds: int
) -> dict[str, Any]:
    """Runs the three variants in turn, `rounds` times, on one prefill and two decodes."""
    prompts = workload(num, seed=7, lengths=(96, 160))
    # NOTE: every fourth request aims at the slow decode, so that all of them fit in one wave
    # of its --prepare-concurrency (8) slots: the slow decode's own grant rate then does not
    # cap the run, and what remains to measure is whether the prefill waits for it.
    targets = [1 if i % 4 == 3 else 0 for i in range(num)]
    healthy = [p for p, t in zip(prompts, targets, strict=True) if t == 0]
    variants = {
        "healthy_only": (healthy, [0] * len(healthy)),
        "slowed": (prompts, targets),
        "all_healthy": (prompts, [0] * num),
    }
    decodes = [await _decode(model_dir), await _decode(model_dir, [SlowAllocate(slow_delay_s)])]
    addresses = [f"127.0.0.1:{d.port}" for d in decodes]
    prefill = await _prefill(model_dir)
    channel = insecure_channel(f"127.0.0.1:{prefill.port}")
    stub = prefill_pb2_grpc.PrefillServiceStub(channel)
    sampling = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def one(request_id: str, prompt: list[int], address: str) -> float:
        async for message in stub.Prefill(_message(request_id, prompt, sampling, address)):
            if message.WhichOneof("event") == "handed_off":
                return time.perf_counter()
        raise RuntimeError(f"{request_id} was not handed off")

    async def run(name: str, r: int) -> dict[str, float]:
        batch, batch_targets = variants[name]
        loadavg = os.getloadavg()[0]
        start = time.perf_counter()
        ends = await asyncio.gather(
            *(
                one(f"{name}-{r}-{i}", p, addresses[t])
                for i, (p, t) in enumerate(zip(batch, batch_targets, strict=True))
            )
        )
        await asyncio.sleep(0.5)  # let the decodes finish the handed-off requests
        healthy_ends = [e for e, t in zip(ends, batch_targets, strict=True) if t == 0]
        healthy_tokens = sum(len(p) for p, t in zip(batch, batch_targets, strict=True) if t == 0)
        return {
            "healthy_tokens_per_s": healthy_tokens / (max(healthy_ends) - start),
            "healthy_done_s": max(healthy_ends) - start,
            "tokens_per_s": sum(len(p) for p in batch) / (max(ends) - start),
            "makespan_s": max(ends) - start,
            "loadavg_1m": loadavg,
        }

    for i in range(2):  # warm-up
        await one(f"warmup-{i}", prompts[i], addresses[0])
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in variants:
            runs[name].append(await run(name, r))
    await channel.close()
    await prefill.stop(grace=None)
    for decode in decodes:
        await decode.stop(grace=None)

    def paired(name: str, base: str, key: str) -> float:
        # NOTE: ratios within a round (neighbouring runs share the machine's background load).
        pairs = zip(runs[name], runs[base], strict=True)
        return statistics.median(a[key] / b[key] for a, b in pairs)

    return {
        "num_requests": num,
        "num_slowed": sum(targets),
        "slow_delay_s": slow_delay_s,
        "runs": runs,
        "total_ratio": paired("slowed", "all_healthy", "tokens_per_s"),
        "healthy_ratio": paired("slowed", "healthy_only", "healthy_tokens_per_s"),
    }


# ---- 3. overlap and chunk size -------------------------------------------------------------


async def transfer_tail(
    model_dir: Path, prompt: list[int], max_chunk_bytes: int
) -> tuple[float, float]:
    """(median first_token -> HandedOff, median time of the same KV sent after compute)."""
    decode = await _decode(model_dir)
    prefill = await _prefill(model_dir, max_chunk_bytes=max_chunk_bytes)
    address = f"127.0.0.1:{decode.port}"
    channel = insecure_channel(f"127.0.0.1:{prefill.port}")
    stub = prefill_pb2_grpc.PrefillServiceStub(channel)
    decode_channel = insecure_channel(address)
    decode_stub = decode_pb2_grpc.DecodeServiceStub(decode_channel)
    sampling = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    tails, serial = [], []
    for i in range(4):
        first = 0.0
        async for message in stub.Prefill(_message(f"c{i}", prompt, sampling, address)):
            if message.WhichOneof("event") == "first_token":
                first = time.perf_counter()
        tails.append(time.perf_counter() - first)
        # The same amount of KV as one SyncCache stream, by the same sender, once everything
        # is computed.
        request = Request(
            request_id=f"s{i}",
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            sampling=sampling,
            seed=0,
            decode_address=address,
            block_ids=list(range(num_blocks_for(len(prompt), BLOCK_SIZE))),
        )
        allocate = convert.allocate_request(
            request, prefill.host.kv_layout, local_protocol(), sender="bench"
        )
        request.lease = convert.lease_from_proto((await decode_stub.AllocateBlocks(allocate)).lease)
        begin = time.perf_counter()
        sender = KvSender(decode_stub, request)
        kv_cache = prefill.host.runner.kv_cache
        for piece in sequence_pieces(kv_cache, request.block_ids, max_chunk_bytes):
            sender.put(piece)
        sender.commit(5, request.first_token_index)
        await sender.run()
        serial.append(time.perf_counter() - begin)
    await channel.close()
    await decode_channel.close()
    await prefill.stop(grace=None)
    await decode.stop(grace=None)
    # NOTE: the first request warms up.
    return statistics.median(tails[1:]), statistics.median(serial[1:])


# ---- main ----------------------------------------------------------------------------------


def _print(results: dict[str, Any]) -> None:
    if "ttft" in results:
        ttft = results["ttft"]
        print(
            f"\nTTFT at {ttft['rate_per_s']}/s, prompts {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} "
            f"tokens, max_tokens {ttft['max_tokens']}"
        )
        print(
            f"{'layout':>9} {'n':>4} {'service p50/p90 s':>18} {'engine p50/p90 s':>17} "
            f"{'ratio p50/p90':>14}"
        )
        for layout, row in ttft["layouts"].items():
            print(
                f"{layout:>9} {row['num_requests']:>4} "
                f"{row['service_p50_s']:>9.3f}{row['service_p90_s']:>9.3f} "
                f"{row['engine_p50_s']:>8.3f}{row['engine_p90_s']:>9.3f} "
                f"{row['service_p50_s'] / row['engine_p50_s']:>7.2f}"
                f"{row['service_p90_s'] / row['engine_p90_s']:>7.2f}"
            )
    if "isolation" in results:
        iso = results["isolation"]
        print(
            f"\nIsolation: {iso['num_requests']} requests sent at once, {iso['num_slowed']} of "
            f"them to a decode that grants leases after {iso['slow_delay_s']}s"
        )
        print(
            f"{'run':>14} {'healthy tok/s':>14} {'healthy done s':>15} {'all tok/s':>10} "
            f"{'makespan s':>11}"
        )
        for name, runs in iso["runs"].items():
            row = sorted(runs, key=lambda run: run["tokens_per_s"])[len(runs) // 2]
            print(
                f"{name:>14} {row['healthy_tokens_per_s']:>14.1f} {row['healthy_done_s']:>15.2f} "
                f"{row['tokens_per_s']:>10.1f} {row['makespan_s']:>11.2f}"
            )
        print(f"prefill throughput, slowed / all_healthy:         {iso['total_ratio']:.3f}")
        print(f"healthy-decode requests, slowed / healthy_only:   {iso['healthy_ratio']:.3f}")
    if "transfer" in results:
        print("\nKV of a 1024-token prompt: transfer time left after the first token")
        print(f"{'chunk':>9} {'layer-wise tail ms':>19} {'sent after compute ms':>22}")
        for size, row in results["transfer"].items():
            print(
                f"{int(size) >> 10:>5} KiB {row['tail_s'] * 1000:>19.1f} "
                f"{row['serial_transfer_s'] * 1000:>22.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--rate", type=float, default=1.5, help="arrivals per second (TTFT)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per request (TTFT)")
    parser.add_argument("--slow-delay-s", type=float, default=1.0)
    parser.add_argument(
        "--parts", nargs="+", default=["ttft", "isolation", "transfer"],
        choices=["ttft", "isolation", "transfer"], help="what to measure",
    )  # fmt: skip
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a checkpoint")
    parser.add_argument("--engine-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    configure_logging("bench", "warning")
    # NOTE: one torch thread in this process too (isolation and transfer parts run in it):
    # multi-threaded torch stalls badly when other processes take a core away.
    torch.set_num_threads(1)
    if args.engine_worker:
        prompts = workload(args.num, seed=args.seed, lengths=PROMPT_TOKENS)
        arrivals = poisson_arrivals(args.num, args.rate, seed=100 + args.seed)
        print(json.dumps(engine_ttft(args.model_dir, prompts, arrivals, args.max_tokens)))
        return
    num_ttft, num_iso, rounds = (6, 8, 1) if args.quick else (12, 32, args.rounds)
    results: dict[str, Any] = {"block_size": BLOCK_SIZE, "max_num_batched_tokens": BUDGET}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_llama(args.model_dir or Path(tmp) / "model")
        if "ttft" in args.parts:
            results["ttft"] = {
                "rate_per_s": args.rate,
                "prompt_tokens": list(PROMPT_TOKENS),
                "max_tokens": args.max_tokens,
                "layouts": ttft_rows(model_dir, num_ttft, args.rate, rounds, args.max_tokens),
            }
        if "isolation" in args.parts:
            results["isolation"] = asyncio.run(
                isolation_rows(model_dir, num_iso, args.slow_delay_s, max(rounds, 5))
            )
        if "transfer" in args.parts:
            long_prompt = workload(1, seed=9, lengths=(1024, 1024))[0]
            results["transfer"] = {}
            for size in (64 << 10, 256 << 10, 1 << 20, 4 << 20):
                tail, whole = asyncio.run(transfer_tail(model_dir, long_prompt, size))
                results["transfer"][str(size)] = {"tail_s": tail, "serial_transfer_s": whole}
    _print(results)
    print("results:", write_results("prefill", results))


if __name__ == "__main__":
    main()
