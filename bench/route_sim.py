"""Routing at scale: the gateway's real registry and router under synthetic load, no model.

    .venv/bin/python bench/route_sim.py                          # 50, 100 and 500 instances
    .venv/bin/python bench/route_sim.py --instances 500 --rate 10000 --seconds 2 --json

Half the instances are prefills, half decodes, all serving one model and one KV layout, in one
`pdserve.gateway.fleet.registry.Registry`; every decision is a real `Router.pick` (cache-aware
routing on, as by default). Time is simulated: requests arrive as a Poisson process at
``--rate`` per second, each with a random prompt (64-2,048 tokens; a quarter share one of 50
system prompts, so the prefix preference has something to do) and 16-256 new tokens. Each
occupies its prefill for a time proportional to the prompt tokens that prefill's own prefix
cache does not hold (each prefill keeps an LRU of its pool's worth of blocks, which the router
only estimates) and its decode for a time proportional to its new tokens; departures release
that load. Instances report their load as heartbeats would, every ``--heartbeat-ms`` of
simulated time, staggered; between reports the router counts what it sent itself and, as the
gateway's attempts do, is told when a prefill computed a prompt and when a decode finished a
request (`Router.settle`; ``--no-settle`` leaves that out, for comparison).

Measured: the wall-clock time of each `Router.pick` call (p50, p99, max), given the
request's block keys (`PromptKeys`, computed once per attempt; their own time is reported
beside it, and the two together), and the load imbalance per role, max /
mean outstanding requests over instances, sampled every 10 ms of simulated time after the
first quarter, averaged over samples. For prefills, which the router balances by queued prompt
tokens (their outstanding work), max / mean queued tokens is reported too. The simulated
prefills are offered about twice the prompt tokens they can compute (a saturated cluster, whose
queues hold tens of requests each): at lower load max / mean over hundreds of instances measures
how few requests each holds, not the router. Goals: p99 at most 100 µs per decision at
500 instances, imbalance at most 1.2.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from common import write_results

from pdserve.common.logging import configure_logging
from pdserve.common.protocol import PROTOCOL_VERSION, kv_layout_fingerprint
from pdserve.gateway.fleet.instance import InstanceInfo, InstanceRole, KvLayout, LoadReport
from pdserve.gateway.fleet.registry import Registry
from pdserve.gateway.routing.prefix_memory import PrefixMemory
from pdserve.gateway.routing.prompt_keys import PromptKeys
from pdserve.gateway.routing.router import Router

MODEL = "sim-model"
BLOCK_SIZE = 16
PREFILL_TOKENS_PER_S = 20_000  # one prefill instance's compute rate
DECODE_TOKENS_PER_S = 40  # one request's decode rate
PREFILL_CACHE_BLOCKS = 20_000  # blocks one prefill's prefix cache holds


def layout() -> KvLayout:
    fields = ("sim-model@0", 24, 8, 128, "KV_DTYPE_BFLOAT16", BLOCK_SIZE)
    return KvLayout(*fields, fingerprint=kv_layout_fingerprint(*fields))


@dataclass
class Instance:
    """One simulated instance: what it is doing and what it last reported."""

    info: InstanceInfo
    outstanding: int = 0  # requests on it now
    queued_tokens: int = 0  # prefill: prompt tokens not yet computed
    used_blocks: int = 0  # decode: blocks held
    num_total_blocks: int = 20_000

    def report(self) -> LoadReport:
        free = self.num_total_blocks - self.used_blocks
        return LoadReport(
            num_queued_prompt_tokens=self.queued_tokens,
            num_running_requests=self.outstanding,
            num_free_blocks=max(0, free),
            num_total_blocks=self.num_total_blocks,
        )


@dataclass(order=True)
class Event:
    at: float
    seq: int
    kind: str = field(compare=False)
    data: Any = field(compare=False, default=None)


def simulate(
    num_instances: int,
    rate: float,
    seconds: float,
    heartbeat_s: float,
    seed: int,
    settle: bool = True,
) -> dict[str, Any]:
    rng = random.Random(seed)
    clock = [0.0]
    registry = Registry(ttl_s=1e9, clock=lambda: clock[0])
    router = Router(registry, rng=random.Random(seed))
    kv_layout = layout()  # one fingerprint, not one per request
    instances: dict[str, Instance] = {}
    for i in range(num_instances):
        role = InstanceRole.PREFILL if i % 2 == 0 else InstanceRole.DECODE
        instance_id = f"{role.value}-{i}"
        info = InstanceInfo(
            instance_id, role, f"10.0.{i // 250}.{i % 250}:5000", PROTOCOL_VERSION, (),
            kv_layout, MODEL, 8192,
        )  # fmt: skip
        instances[instance_id] = Instance(info)
        registry.register(info, instances[instance_id].report())
    system_prompts = [[rng.randrange(1000, 30000) for _ in range(512)] for _ in range(50)]
    # NOTE: what each prefill's prefix cache holds (its pool's worth of blocks, least recently
    # used forgotten first), which the router only estimates.
    prefill_caches = PrefixMemory(PREFILL_CACHE_BLOCKS)
    events: list[Event] = []
    seq = 0

    def push(at: float, kind: str, data: Any = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, Event(at, seq, kind, data))

    for i, instance_id in enumerate(instances):
        push(heartbeat_s * i / num_instances, "heartbeat", instance_id)
    push(rng.expovariate(rate), "arrival")
    push(0.01, "sample")
    pick_ns: list[int] = []
    keys_ns: list[int] = []
    imbalance: dict[str, list[float]] = {"prefill": [], "decode": [], "prefill_tokens": []}
    while events:
        event = heapq.heappop(events)
        clock[0] = event.at
        if event.at > seconds:
            break
        if event.kind == "arrival":
            push(event.at + rng.expovariate(rate), "arrival")
            length = rng.randrange(64, 2049)
            if rng.random() < 0.25:
                prompt = rng.choice(system_prompts) + [
                    rng.randrange(1000, 30000) for _ in range(length // 4)
                ]
            else:
                prompt = [rng.randrange(1000, 30000) for _ in range(length)]
            new_tokens = rng.randrange(16, 257)
            began = time.perf_counter_ns()
            keys = PromptKeys(prompt)
            keys.of(kv_layout)
            keys_ns.append(time.perf_counter_ns() - began)
            began = time.perf_counter_ns()
            pair = router.pick(MODEL, prompt, new_tokens, prompt_keys=keys)
            pick_ns.append(time.perf_counter_ns() - began)
            prefill = instances[pair.prefill.instance_id]
            decode = instances[pair.decode.instance_id]
            # NOTE: the prefill computes what its own cache does not hold.
            num_cached = BLOCK_SIZE * prefill_caches.num_matched_blocks(
                prefill.info.instance_id, keys.reusable(kv_layout)
            )
            prefill_caches.record(prefill.info.instance_id, keys.of(kv_layout))
            num_computed = len(prompt) - num_cached
            prefill.outstanding += 1
            prefill.queued_tokens += num_computed
            blocks = -(-(len(prompt) + new_tokens) // BLOCK_SIZE)
            decode.outstanding += 1
            decode.used_blocks += blocks
            prefill_done = event.at + prefill.queued_tokens / PREFILL_TOKENS_PER_S
            push(prefill_done, "prefilled", (prefill, num_computed, pair))
            push(prefill_done + new_tokens / DECODE_TOKENS_PER_S, "decoded", (decode, blocks, pair))
        elif event.kind == "prefilled":
            prefill, num_tokens, pair = event.data
            prefill.outstanding -= 1
            prefill.queued_tokens -= num_tokens
            if settle:
                router.settle(pair, InstanceRole.PREFILL)
        elif event.kind == "decoded":
            decode, blocks, pair = event.data
            decode.outstanding -= 1
            decode.used_blocks -= blocks
            if settle:
                router.settle(pair, InstanceRole.DECODE)
        elif event.kind == "heartbeat":
            registry.heartbeat(event.data, instances[event.data].report())
            push(event.at + heartbeat_s, "heartbeat", event.data)
        elif event.kind == "sample":
            push(event.at + 0.01, "sample")
            if event.at >= seconds / 4:
                for role in ("prefill", "decode"):
                    loads = [x.outstanding for x in instances.values() if x.info.role.value == role]
                    mean = statistics.fmean(loads)
                    if mean > 0:
                        imbalance[role].append(max(loads) / mean)
                tokens = [
                    x.queued_tokens for x in instances.values() if x.info.role.value == "prefill"
                ]
                if statistics.fmean(tokens) > 0:
                    imbalance["prefill_tokens"].append(max(tokens) / statistics.fmean(tokens))
    pick_us = sorted(ns / 1000 for ns in pick_ns)
    keys_us = sorted(ns / 1000 for ns in keys_ns)
    both_us = sorted((a + b) / 1000 for a, b in zip(pick_ns, keys_ns, strict=True))
    return {
        "instances": num_instances,
        "rate_per_s": rate,
        "decisions": len(pick_us),
        "pick_us_p50": round(pick_us[len(pick_us) // 2], 1),
        "pick_us_p99": round(pick_us[int(len(pick_us) * 0.99)], 1),
        "pick_us_max": round(pick_us[-1], 1),
        "keys_us_p50": round(keys_us[len(keys_us) // 2], 1),
        "keys_us_p99": round(keys_us[int(len(keys_us) * 0.99)], 1),
        "pick_and_keys_us_p50": round(both_us[len(both_us) // 2], 1),
        "pick_and_keys_us_p99": round(both_us[int(len(both_us) * 0.99)], 1),
        "imbalance_prefill": round(statistics.fmean(imbalance["prefill"]), 3),
        "imbalance_decode": round(statistics.fmean(imbalance["decode"]), 3),
        "imbalance_prefill_tokens": round(statistics.fmean(imbalance["prefill_tokens"]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, nargs="+", default=[50, 100, 500])
    parser.add_argument("--rate", type=float, default=10_000, help="arrivals per simulated second")
    parser.add_argument("--seconds", type=float, default=2.0, help="simulated seconds")
    parser.add_argument("--heartbeat-ms", type=float, default=500.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-settle",
        action="store_true",
        help="do not tell the router when work ends (it knows only reports and its own sends)",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON, last")
    args = parser.parse_args()
    configure_logging("route-sim", "warning", json=False)  # not a line per registration
    rows = []
    print(f"{'instances':>9} {'decisions':>9} {'p50 µs':>8} {'p99 µs':>8} {'max µs':>9} "
          f"{'keys p99':>8} {'both p50':>8} {'both p99':>8} {'imbalance P':>11} "
          f"{'imbalance D':>11} {'P tokens':>8}")  # fmt: skip
    heartbeat_s = args.heartbeat_ms / 1000
    for num_instances in args.instances:
        row = simulate(
            num_instances, args.rate, args.seconds, heartbeat_s, args.seed, not args.no_settle
        )
        rows.append(row)
        print(
            f"{row['instances']:>9} {row['decisions']:>9} {row['pick_us_p50']:>8.1f} "
            f"{row['pick_us_p99']:>8.1f} {row['pick_us_max']:>9.1f} {row['keys_us_p99']:>8.1f} "
            f"{row['pick_and_keys_us_p50']:>8.1f} {row['pick_and_keys_us_p99']:>8.1f} "
            f"{row['imbalance_prefill']:>11.3f} {row['imbalance_decode']:>11.3f} "
            f"{row['imbalance_prefill_tokens']:>8.3f}",
            flush=True,
        )
    print(
        f"results: {write_results('route_sim', {'command': ' '.join(sys.argv[1:]), 'rows': rows})}"
    )
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
