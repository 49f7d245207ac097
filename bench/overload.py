"""Overload: pdserve queueing past its KV capacity, against just enough load and the colocated
engine under the same overload.

The decode gets a small explicit KV pool, ``--num-blocks B`` with B chosen so that it holds
``--capacity C`` requests at their full length (prompt + output, rounded up to whole blocks;
the longest prompt of the workload counts); the colocated engine gets the same B. Closed-loop
rounds on the real model (SmolLM2-135M-Instruct), each client sending
``--requests-per-client`` requests one after another:

* pdserve (gateway + 1 prefill + 1 decode, the launcher) at C clients ("just enough"), 2C and
  4C: past C the gateway's admission queue holds what no decode has room for, instead of
  answering 429;
* the colocated engine (bench/colocated_server.py, one process with its own waiting queue) at
  the ``--colocated-levels`` multiples of C (default 1 and 4);
* a cancellation round at 4C on each: ``--cancel-fraction`` (30%) of the requests, picked by a
  seeded RNG, are dropped by their client at a random moment: half after a random 0-2 s delay
  (at 4C most are still queued or prefilling then), half after a random number of streamed
  tokens. They count as cancelled, not as errors; errors among the rest should be 0. Some
  seconds after the round every decode and prefill block must be free again
  (``pdserve_<role>_free_blocks == pdserve_<role>_total_blocks``) and the gateway's queue
  empty (``pdserve_gateway_queued_requests == 0``): PASS or FAIL.

Per round: requests, errors (count and the first messages), output tokens/s, TTFT and
end-to-end p50/p99; for pdserve, from the gateway's ``/metrics`` scraped before and after the
round: queue waits observed (count, mean), refusals by bound, retries by reason, reschedules by
cause, request outcomes, the deepest queue seen (sampled every second); from the decode's:
preemptions. Ratios: throughput and TTFT at 2C and 4C over C, and pdserve over colocated at 4C.

Prompts are random words (bench/loadgen.py) of one character length, calibrated with the
model's tokenizer to about ``--prompt-tokens`` (300) tokens; ``--output-tokens`` (128) exactly
(``ignore_eos``), greedy, streamed. Every round uses its own prompts (no prefix-cache hits
across rounds); pdserve and the colocated engine get the same ones at the same level.

    .venv/bin/python bench/overload.py                 # C=4: rounds at 4, 8, 16 clients
    .venv/bin/python bench/overload.py --quick         # C=2, 2 requests per client, 32 tokens
    .venv/bin/python bench/overload.py --capacity 8 --colocated-levels 4

The servers' logs go to a temporary directory (printed); a count of the gateway's warning and
error events by name goes into the results, which are written to
bench/results/overload-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from common import write_results
from loadgen import (
    RequestResult,
    RequestSpec,
    completion_body,
    make_workload,
    send,
    summarize,
)
from prometheus_client.parser import text_string_to_metric_families
from serve import colocated_server, served_model, smollm2_model_dir
from tqdm import tqdm

# (sample name, sorted label items) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# ---- servers ---------------------------------------------------------------------------------


@dataclass
class PdserveHandle:
    """A running pdserve cluster: its REST URL and each service's /metrics URL."""

    url: str
    gateway_metrics: str
    decode_metrics: list[str]
    prefill_metrics: list[str]
    cluster: Any
    log_dir: Path


@contextlib.contextmanager
def pdserve_cluster(
    model: Path, threads: int, log_dir: Path, num_blocks: int, block_size: int
) -> Iterator[PdserveHandle]:
    """gateway + 1 prefill + 1 decode (the launcher), the decode with `num_blocks` KV blocks."""
    from pdserve.launcher.cluster import Cluster
    from pdserve.launcher.config import ClusterConfig

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    config = ClusterConfig(
        model=str(model),
        port=0,
        grpc_port=0,
        internal_port=0,
        log_dir=str(log_dir),
        decode_args=f"--num-blocks {num_blocks} --block-size {block_size}",
        prefill_args=f"--block-size {block_size}",
    )
    cluster = Cluster(config, env=env)
    cluster.start()
    try:

        def metrics_of(children: list[Any]) -> list[str]:
            found = [child.wait_for_event("metrics_started", 30) for child in children]
            return [f"http://{record['address']}/metrics" for record in found]

        yield PdserveHandle(
            url=cluster.rest_url,
            gateway_metrics=f"{cluster.rest_url}/metrics",
            decode_metrics=metrics_of(cluster.decodes),
            prefill_metrics=metrics_of(cluster.prefills),
            cluster=cluster,
            log_dir=log_dir,
        )
    finally:
        cluster.stop(timeout_s=20)


# ---- metrics ---------------------------------------------------------------------------------


def scrape(url: str) -> Samples | None:
    """Every sample at a Prometheus ``/metrics`` URL; None when it does not answer."""
    try:
        response = httpx.get(url, timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse(response.text)


def parse(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples | None, name: str) -> float | None:
    """An unlabelled sample's value."""
    return None if samples is None else samples.get((name, ()))


def by_label(samples: Samples | None, name: str, label: str) -> dict[str, float]:
    """A labelled series' values by one label."""
    return {
        dict(labels).get(label, ""): number
        for (sample, labels), number in (samples or {}).items()
        if sample == name
    }


def delta_by_label(before: Samples, after: Samples, name: str, label: str) -> dict[str, float]:
    """How much each series of a labelled counter grew (only those that did)."""
    old = by_label(before, name, label)
    grown = {
        key: number - old.get(key, 0.0) for key, number in by_label(after, name, label).items()
    }
    return {key: round(number, 3) for key, number in sorted(grown.items()) if number}


def delta(before: Samples | None, after: Samples | None, name: str) -> float | None:
    old, new = value(before, name), value(after, name)
    return None if old is None or new is None else new - old


def gateway_round(before: Samples | None, after: Samples | None) -> dict[str, Any]:
    """What the gateway counted between two scrapes."""
    if before is None or after is None:
        return {"scraped": False}
    waits = delta(before, after, "pdserve_gateway_queue_wait_seconds_count") or 0.0
    wait_sum = delta(before, after, "pdserve_gateway_queue_wait_seconds_sum") or 0.0
    return {
        "queue_waits": int(waits),
        "queue_wait_mean_s": round(wait_sum / waits, 3) if waits else None,
        "refusals": delta_by_label(before, after, "pdserve_gateway_queue_refusals_total", "bound"),
        "retries": delta_by_label(before, after, "pdserve_gateway_retries_total", "reason"),
        "reschedules": delta_by_label(before, after, "pdserve_gateway_reschedules_total", "cause"),
        "outcomes": delta_by_label(before, after, "pdserve_gateway_requests_total", "outcome"),
    }


def pool_state(samples: Samples | None, role: str) -> dict[str, float | None]:
    return {
        key: value(samples, f"pdserve_{role}_{key}")
        for key in ("free_blocks", "total_blocks", "leased_blocks", "running_requests",
                    "queued_requests")
    }  # fmt: skip


class Sampler:
    """Polls the gateway's queue gauge and the decode's free blocks every `interval_s`."""

    def __init__(self, gateway: str, decode: str | None, interval_s: float = 1.0) -> None:
        self.gateway, self.decode, self.interval_s = gateway, decode, interval_s
        self.max_queued = 0.0
        self.min_free_blocks: float | None = None

    async def run(self, http: httpx.AsyncClient) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                samples = parse((await http.get(self.gateway, timeout=5)).text)
                queued = value(samples, "pdserve_gateway_queued_requests") or 0.0
                self.max_queued = max(self.max_queued, queued)
                if self.decode is not None:
                    samples = parse((await http.get(self.decode, timeout=5)).text)
                    free = value(samples, "pdserve_decode_free_blocks")
                    if free is not None:
                        low = self.min_free_blocks
                        self.min_free_blocks = free if low is None else min(low, free)
            await asyncio.sleep(self.interval_s)


# ---- load with cancellations -----------------------------------------------------------------


@dataclass(frozen=True)
class Cancel:
    """When a client drops its request: `after_s` seconds after sending it, or once
    `after_tokens` tokens have streamed."""

    after_s: float | None = None
    after_tokens: int | None = None


@dataclass
class Outcome:
    """One request of a round: its result, and how it was cancelled if it was."""

    result: RequestResult
    cancelled: str | None = None  # "before_first_token", "after_tokens" or None
    planned: Cancel | None = None


def plan_cancels(
    num_requests: int, fraction: float, max_tokens: int, seed: int
) -> list[Cancel | None]:
    """`fraction` of the requests cancelled: half after a 0-2 s delay, half after 1 to
    max_tokens - 1 streamed tokens."""
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(num_requests), round(fraction * num_requests)))
    plans: list[Cancel | None] = [None] * num_requests
    for position, index in enumerate(chosen):
        if position % 2 == 0:
            plans[index] = Cancel(after_s=rng.uniform(0.0, 2.0))
        else:
            plans[index] = Cancel(after_tokens=rng.randint(1, max(1, max_tokens - 1)))
    return plans


async def send_and_cancel(
    http: httpx.AsyncClient, model: str, spec: RequestSpec, timeout_s: float, cancel: Cancel
) -> Outcome:
    """Streams one completion and drops it as `cancel` says (closing the connection)."""
    body = completion_body(model, spec)
    start = time.perf_counter()
    num_tokens = 0
    first_token_s = math.nan
    usage: dict[str, Any] = {}
    try:
        async with asyncio.timeout(cancel.after_s):
            async with http.stream(
                "POST", "/v1/completions", json=body, timeout=timeout_s
            ) as reply:
                if reply.status_code != 200:
                    text = (await reply.aread()).decode(errors="replace")
                    error = f"HTTP {reply.status_code}: {text[:200]}"
                    return Outcome(RequestResult(is_ok=False, error=error), planned=cancel)
                async for line in reply.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        error = str(data["error"])[:200]
                        return Outcome(RequestResult(is_ok=False, error=error), planned=cancel)
                    usage = data.get("usage") or usage
                    for choice in data.get("choices", []):
                        ids = choice.get("token_ids")
                        num = len(ids) if ids is not None else int(bool(choice.get("text")))
                        if num and not num_tokens:
                            first_token_s = time.perf_counter() - start
                        num_tokens += num
                    if cancel.after_tokens is not None and num_tokens >= cancel.after_tokens:
                        # NOTE: leaving the block closes the connection: the client is gone.
                        return Outcome(
                            RequestResult(is_ok=True, num_output_tokens=num_tokens,
                                          ttft_s=first_token_s),
                            cancelled="after_tokens", planned=cancel,
                        )  # fmt: skip
    except TimeoutError:
        kind = "before_first_token" if not num_tokens else "after_tokens"
        result = RequestResult(is_ok=True, num_output_tokens=num_tokens, ttft_s=first_token_s)
        return Outcome(result, cancelled=kind, planned=cancel)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        return Outcome(RequestResult(is_ok=False, error=repr(error)[:200]), planned=cancel)
    # NOTE: it finished before its cancel came; counted with the completed requests.
    if not num_tokens:
        return Outcome(RequestResult(is_ok=False, error="no tokens"), planned=cancel)
    end = time.perf_counter() - start
    result = RequestResult(
        is_ok=True,
        num_prompt_tokens=int(usage.get("prompt_tokens") or 0),
        num_output_tokens=int(usage.get("completion_tokens") or num_tokens),
        ttft_s=first_token_s,
        tpot_s=(end - first_token_s) / (num_tokens - 1) if num_tokens > 1 else math.nan,
        e2e_s=end,
    )
    return Outcome(result, planned=cancel)


async def closed_loop(
    url: str,
    model: str,
    specs: list[RequestSpec],
    concurrency: int,
    cancels: list[Cancel | None],
    timeout_s: float,
    label: str,
    sampler: Sampler | None,
) -> tuple[list[Outcome], float]:
    """`concurrency` clients send `specs` in order, each its next one when the last ends."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    outcomes: list[Outcome | None] = [None] * len(specs)
    progress = tqdm(
        total=len(specs), desc=label, unit="req", leave=False, disable=not sys.stderr.isatty()
    )
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s) as http:
        sampling = asyncio.create_task(sampler.run(http)) if sampler is not None else None
        next_index = 0
        start = time.perf_counter()

        async def client() -> None:
            nonlocal next_index
            while next_index < len(specs):
                index, next_index = next_index, next_index + 1
                plan = cancels[index]
                if plan is None:
                    outcomes[index] = Outcome(await send(http, model, specs[index], timeout_s))
                else:
                    outcomes[index] = await send_and_cancel(
                        http, model, specs[index], timeout_s, plan
                    )
                progress.update()

        try:
            await asyncio.gather(*(client() for _ in range(concurrency)))
        finally:
            duration_s = time.perf_counter() - start
            if sampling is not None:
                sampling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampling
            progress.close()
    return [o for o in outcomes if o is not None], duration_s


# ---- rounds ----------------------------------------------------------------------------------


@dataclass
class Round:
    """One round's settings."""

    server: str  # "pdserve" or "colocated"
    name: str  # "C", "2C", "4C", "4C cancel"
    concurrency: int
    specs: list[RequestSpec]
    cancels: list[Cancel | None] = field(default_factory=list)


def round_summary(outcomes: list[Outcome], duration_s: float) -> dict[str, Any]:
    """The load generator's summary of the requests not cancelled, and cancellation counts."""
    kept = [o.result for o in outcomes if o.cancelled is None]
    summary = summarize(kept, duration_s) if kept else {"num_requests": 0, "num_errors": 0}
    cancelled = Counter(o.cancelled for o in outcomes if o.cancelled is not None)
    summary["num_sent"] = len(outcomes)
    summary["num_cancelled"] = sum(cancelled.values())
    summary["cancelled"] = dict(cancelled)
    summary["num_cancel_planned"] = sum(o.planned is not None for o in outcomes)
    # NOTE: tokens streamed to clients that then left count toward the throughput too.
    streamed = sum(o.result.num_output_tokens for o in outcomes if o.result.is_ok)
    summary["streamed_tokens_per_s"] = round(streamed / duration_s, 2)
    return summary


def run_round(
    spec: Round,
    url: str,
    model: str,
    timeout_s: float,
    handle: PdserveHandle | None,
) -> dict[str, Any]:
    label = f"{spec.server} {spec.name} ({spec.concurrency} clients)"
    cancels = spec.cancels or [None] * len(spec.specs)
    before_gw = scrape(handle.gateway_metrics) if handle else None
    before_decode = scrape(handle.decode_metrics[0]) if handle else None
    sampler = (
        Sampler(handle.gateway_metrics, handle.decode_metrics[0]) if handle is not None else None
    )
    outcomes, duration_s = asyncio.run(
        closed_loop(url, model, spec.specs, spec.concurrency, cancels, timeout_s, label, sampler)
    )
    summary = round_summary(outcomes, duration_s)
    record: dict[str, Any] = {
        "server": spec.server,
        "round": spec.name,
        "concurrency": spec.concurrency,
        "summary": summary,
    }
    if handle is not None and sampler is not None:
        after_gw = scrape(handle.gateway_metrics)
        after_decode = scrape(handle.decode_metrics[0])
        record["gateway"] = gateway_round(before_gw, after_gw)
        record["gateway"]["max_queued_requests_seen"] = int(sampler.max_queued)
        preemptions = delta(before_decode, after_decode, "pdserve_decode_preemptions_total")
        record["decode"] = {
            "preemptions": None if preemptions is None else int(preemptions),
            "min_free_blocks_seen": sampler.min_free_blocks,
        }
        exited = handle.cluster.first_exited()
        if exited is not None:
            record["exited"] = exited.describe_exit()
    if spec.cancels:
        record["cleanup"] = check_cleanup(handle) if handle is not None else None
    line = (
        f"{spec.server} {spec.name}: {summary['num_sent']} sent, {summary['num_errors']} errors, "
        f"{summary['num_cancelled']} cancelled {summary['cancelled'] or ''}, "
        f"{summary.get('output_tokens_per_s')} output tok/s, "
        f"TTFT p50 {summary.get('ttft_p50_ms')} ms, mean prompt {summary.get('mean_prompt_tokens')}"
        " tokens"
    )
    print(line, flush=True)
    if summary.get("errors"):
        print(f"  errors: {summary['errors']}", flush=True)
    if record.get("cleanup"):
        print(f"  every block free afterwards: {record['cleanup']['verdict']}", flush=True)
    return record


def check_cleanup(handle: PdserveHandle, wait_s: float = 20.0) -> dict[str, Any]:
    """Waits up to `wait_s` for every decode and prefill block to be free and the gateway's
    queue to be empty (checked after a 3 s pause, then every second)."""
    time.sleep(3)
    deadline = time.monotonic() + wait_s
    while True:
        gateway = scrape(handle.gateway_metrics)
        pools = {
            f"{role}-{i}": pool_state(scrape(url), role)
            for role, urls in (("decode", handle.decode_metrics),
                               ("prefill", handle.prefill_metrics))
            for i, url in enumerate(urls)
        }  # fmt: skip
        queued = value(gateway, "pdserve_gateway_queued_requests")
        is_free = all(
            pool["total_blocks"] is not None and pool["free_blocks"] == pool["total_blocks"]
            for pool in pools.values()
        )
        is_pass = is_free and queued == 0
        if is_pass or time.monotonic() > deadline:
            return {
                "verdict": "PASS" if is_pass else "FAIL",
                "gateway_queued_requests": queued,
                "pools": pools,
                "waited_s": round(wait_s - (deadline - time.monotonic()) + 3, 1),
            }
        time.sleep(1)


def warm_up(url: str, model: str, prompt_chars: int, seed: int) -> None:
    """A few short requests, so the first round does not pay for first-call costs."""
    specs = make_workload(4, (prompt_chars, prompt_chars), (8, 8), None, seed)
    outcomes, _ = asyncio.run(closed_loop(url, model, specs, 2, [None] * 4, 120.0, "warm-up", None))
    errors = [o.result.error for o in outcomes if not o.result.is_ok]
    if errors:
        print(f"warm-up errors: {errors}", flush=True)


# ---- calibration -----------------------------------------------------------------------------


def calibrate_prompt_chars(tokenizer: Any, target_tokens: int, seed: int) -> tuple[int, float]:
    """A prompt length in characters whose random-word prompts average `target_tokens`."""
    chars = target_tokens * 4
    mean = 0.0
    for _ in range(4):
        specs = make_workload(64, (chars, chars), (1, 1), None, seed)
        mean = sum(len(tokenizer.encode(s.prompt)) for s in specs) / len(specs)
        if abs(mean - target_tokens) < 1:
            break
        chars = max(1, round(chars * target_tokens / mean))
    return chars, mean


# ---- output ----------------------------------------------------------------------------------


def _fmt(number: Any, digits: int = 0) -> str:
    if number is None:
        return "-"
    if isinstance(number, float):
        return f"{number:,.{digits}f}"
    return str(number)


def _counts(counts: dict[str, float] | None) -> str:
    if not counts:
        return "0"
    return " ".join(f"{key}={int(number)}" for key, number in counts.items())


def print_tables(records: list[dict[str, Any]]) -> None:
    print()
    header = (
        f"{'round':<20}{'clients':>8}{'sent':>6}{'errors':>7}{'cancel':>7}{'out tok/s':>10}"
        f"{'TTFT p50':>10}{'TTFT p99':>10}{'e2e p50':>10}{'e2e p99':>10}"
    )
    print(header + "   (ms)")
    for record in records:
        s = record["summary"]
        print(
            f"{record['server'] + ' ' + record['round']:<20}{record['concurrency']:>8}"
            f"{s['num_sent']:>6}{s['num_errors']:>7}{s['num_cancelled']:>7}"
            f"{_fmt(s.get('output_tokens_per_s'), 1):>10}{_fmt(s.get('ttft_p50_ms')):>10}"
            f"{_fmt(s.get('ttft_p99_ms')):>10}{_fmt(s.get('e2e_p50_ms')):>10}"
            f"{_fmt(s.get('e2e_p99_ms')):>10}"
        )
    print()
    print(f"{'pdserve round':<20}{'waits':>6}{'mean wait s':>12}{'max queued':>11}"
          f"{'preempt':>8}  refusals / retries / reschedules")  # fmt: skip
    for record in records:
        if "gateway" not in record:
            continue
        gateway, decode = record["gateway"], record["decode"]
        print(
            f"{record['round']:<20}{gateway.get('queue_waits', '-'):>6}"
            f"{_fmt(gateway.get('queue_wait_mean_s'), 2):>12}"
            f"{gateway.get('max_queued_requests_seen', '-'):>11}"
            f"{_fmt(decode.get('preemptions')):>8}  {_counts(gateway.get('refusals'))} / "
            f"{_counts(gateway.get('retries'))} / {_counts(gateway.get('reschedules'))}"
        )
    for record in records:
        for error in record["summary"].get("errors") or []:
            print(f"error ({record['server']} {record['round']}): {error}")
        if record.get("cleanup"):
            cleanup = record["cleanup"]
            print(
                f"{record['server']} {record['round']}: every block free afterwards: "
                f"{cleanup['verdict']} (gateway queued {cleanup['gateway_queued_requests']}, "
                + ", ".join(
                    f"{name} {_fmt(pool['free_blocks'])}/{_fmt(pool['total_blocks'])} free"
                    for name, pool in cleanup["pools"].items()
                )
                + ")"
            )


def ratios(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Throughput and TTFT at each level over "just enough" (C), and pdserve / colocated."""
    plain = {(r["server"], r["round"]): r["summary"] for r in records if "cancel" not in r["round"]}
    keys = ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms")

    def ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
        return {
            key: round(a[key] / b[key], 2) if a.get(key) and b.get(key) else None for key in keys
        }

    out: dict[str, Any] = {}
    for server in ("pdserve", "colocated"):
        base = plain.get((server, "C"))
        if base is None:
            continue
        for (name, level), summary in plain.items():
            if name == server and level != "C":
                out[f"{server} {level} / C"] = ratio(summary, base)
    for level in {level for _, level in plain}:
        if ("pdserve", level) in plain and ("colocated", level) in plain:
            out[f"pdserve / colocated at {level}"] = ratio(
                plain[("pdserve", level)], plain[("colocated", level)]
            )
    return out


def print_ratios(table: dict[str, Any]) -> None:
    print()
    print(f"{'ratio':<30}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'e2e p50':>10}")
    for name, row in table.items():
        print(
            f"{name:<30}{_fmt(row['output_tokens_per_s'], 2):>10}"
            f"{_fmt(row['ttft_p50_ms'], 2):>10}{_fmt(row['ttft_p99_ms'], 2):>10}"
            f"{_fmt(row['e2e_p50_ms'], 2):>10}"
        )


def log_events(path: Path) -> dict[str, int]:
    """Warning and error events in a service's log, by event name."""
    counts: Counter[str] = Counter()
    if not path.is_file():
        return {}
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("level") in ("warning", "error"):
                counts[str(record.get("event"))] += 1
    return dict(counts.most_common())


# ---- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--capacity", type=int, default=4, help="C: requests the KV pool holds")
    parser.add_argument("--num-blocks", type=int, help="KV blocks (default: C full requests)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=300, help="mean prompt length")
    parser.add_argument("--prompt-chars", type=int, help="skip the calibration: this many chars")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument(
        "--levels", default="1,2,4", help="pdserve rounds: multiples of C (the first is C)"
    )
    parser.add_argument(
        "--colocated-levels",
        default="1,4",
        help="colocated rounds: multiples of C; empty for none",
    )
    parser.add_argument("--cancel-level", type=int, default=4, help="multiple of C; 0: no round")
    parser.add_argument("--cancel-fraction", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", help="serve this model directory (default: SmolLM2)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: C=2, 2 requests per client, 32 output tokens",
    )
    return parser


def levels(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    args = build_parser().parse_args()
    if args.quick:
        args.capacity, args.requests_per_client, args.output_tokens = 2, 2, 32
    from pdserve.tokenizer import Tokenizer

    model_dir = Path(args.model_dir) if args.model_dir else smollm2_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    if args.prompt_chars:
        prompt_chars, _ = args.prompt_chars, 0.0
    else:
        prompt_chars, _ = calibrate_prompt_chars(tokenizer, args.prompt_tokens, args.seed)
    c = args.capacity
    output = args.output_tokens

    def workload(level: int, seed: int) -> list[RequestSpec]:
        count = level * c * args.requests_per_client
        return make_workload(count, (prompt_chars, prompt_chars), (output, output), None, seed)

    pd_levels, co_levels = levels(args.levels), levels(args.colocated_levels)
    names = {level: "C" if level == 1 else f"{level}C" for level in {*pd_levels, *co_levels}}
    # NOTE: one workload per level (its own seed: no shared prefixes between rounds); pdserve
    # and the colocated engine get the same one at the same level.
    workloads = {lv: workload(lv, args.seed + lv) for lv in {*pd_levels, *co_levels}}
    cancel_specs = workload(args.cancel_level, args.seed + 1000) if args.cancel_level else []
    cancels = plan_cancels(len(cancel_specs), args.cancel_fraction, output, args.seed + 1001)
    prompt_tokens = [
        len(tokenizer.encode(s.prompt))
        for specs in [*workloads.values(), cancel_specs]
        for s in specs
    ]
    mean_tokens = sum(prompt_tokens) / len(prompt_tokens)
    blocks_per_request = math.ceil((max(prompt_tokens) + output) / args.block_size)
    num_blocks = args.num_blocks or c * blocks_per_request
    print(
        f"prompts: {prompt_chars} characters = {mean_tokens:.1f} tokens on average "
        f"({min(prompt_tokens)}-{max(prompt_tokens)}), {output} output tokens; KV pool "
        f"{num_blocks} blocks of {args.block_size} = {c} requests of "
        f"{blocks_per_request} blocks at full length",
        flush=True,
    )

    log_dir = Path(tempfile.mkdtemp(prefix="bench-overload-logs-"))
    print(f"logs: {log_dir}", flush=True)
    records: list[dict[str, Any]] = []
    started = time.time()
    with pdserve_cluster(model_dir, args.threads, log_dir, num_blocks, args.block_size) as pd:
        model = served_model(pd.url)
        warm_up(pd.url, model, prompt_chars, args.seed + 500)
        rounds = [Round("pdserve", names[lv], lv * c, workloads[lv]) for lv in pd_levels]
        if args.cancel_level:
            name = f"{args.cancel_level}C cancel" if args.cancel_level > 1 else "C cancel"
            rounds.append(Round("pdserve", name, args.cancel_level * c, cancel_specs, cancels))
        for spec in rounds:
            records.append(run_round(spec, pd.url, model, args.timeout_s, pd))
        gateway_events = log_events(log_dir / "gateway.log")
        decode_events = log_events(log_dir / "decode-0.log")
        prefill_events = log_events(log_dir / "prefill-0.log")
    if co_levels or args.cancel_level:
        extra = ["--num-blocks", str(num_blocks), "--block-size", str(args.block_size)]
        with colocated_server(model_dir, args.threads, log_dir, extra) as url:
            model = served_model(url)
            warm_up(url, model, prompt_chars, args.seed + 500)
            rounds = [Round("colocated", names[lv], lv * c, workloads[lv]) for lv in co_levels]
            if args.cancel_level:
                name = f"{args.cancel_level}C cancel" if args.cancel_level > 1 else "C cancel"
                rounds.append(
                    Round("colocated", name, args.cancel_level * c, cancel_specs, cancels)
                )
            for spec in rounds:
                records.append(run_round(spec, url, model, args.timeout_s, None))

    print_tables(records)
    table = ratios(records)
    print_ratios(table)
    print(f"\nwarning/error events: gateway {gateway_events}, prefill {prefill_events}, "
          f"decode {decode_events}")  # fmt: skip
    pd_rounds = [r for r in records if r["server"] == "pdserve"]
    results = {
        "command": " ".join(sys.argv[1:]),
        "settings": vars(args),
        "model_dir": model_dir.name,
        "prompt_chars": prompt_chars,
        "mean_prompt_tokens": round(mean_tokens, 1),
        "max_prompt_tokens": max(prompt_tokens),
        "num_blocks": num_blocks,
        "blocks_per_request": blocks_per_request,
        "duration_s": round(time.time() - started, 1),
        "rounds": records,
        "ratios": table,
        "pdserve_errors": sum(r["summary"]["num_errors"] for r in pd_rounds),
        "log_events": {"gateway": gateway_events, "prefill": prefill_events,
                       "decode": decode_events},
    }  # fmt: skip
    path = write_results("overload", results)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
