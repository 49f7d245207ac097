"""What the OpenAI sampling controls cost, on the default model (SmolLM2-135M-Instruct), as
ratios measured in one run.

``step``: the decode step (one batched forward pass over the paged cache, then sampling) with
16 streams, every control off vs on for every stream (presence, frequency and repetition
penalties, a 16-entry logit_bias, min_p, top-20 logprobs), and vs the token filters on every
stream (a 1,000-id ``allowed_token_ids``, 8 two-token ``bad_words``). The settings take turns
step by step on the same batch, so drift hits them alike.

``n``: ``n=4`` against 4 separate requests with the same ~1,000-token prompt sent at once,
through gateway, prefill and decode processes: prompt tokens the prefill computed, KV bytes it
shipped (what the decode received), the prompt blocks the decode shared between choices
instead of receiving them, and the end-to-end time. Run:

    .venv/bin/python bench/sampling.py [--steps 40] [--skip-n]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import prefilled_streams, write_results
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.generation import SamplingParams
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model
from pdserve.engine.sampler import Sampler, SamplingRow

NUM_STREAMS = 16
PROMPT_LEN = 256
BLOCK_SIZE = 16
OFF = SamplingParams(temperature=0.8, seed=1, max_tokens=1024)
ON = SamplingParams(
    temperature=0.8,
    seed=1,
    max_tokens=1024,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
    logit_bias=tuple((t, 1.0) for t in range(100, 116)),
    min_p=0.05,
    logprobs=20,
)
# NOTE: vLLM's token filters: a 1,000-id allow list and 8 two-token bad words on every stream.
FILTERS = SamplingParams(
    temperature=0.8,
    seed=1,
    max_tokens=1024,
    allowed_token_ids=tuple(range(1000, 2000)),
    bad_words=tuple((t, t + 1) for t in range(1000, 1016, 2)),
)


def bench_step(model_dir: Path, num_steps: int) -> dict[str, Any]:
    """Median decode-step time with the controls off, on, and the token filters, in turn."""
    runner, sequences, tables = prefilled_streams(
        model_dir, NUM_STREAMS, PROMPT_LEN, num_steps * 3, BLOCK_SIZE
    )
    sampler = Sampler()
    settings = [("off", OFF), ("on", ON), ("filters", FILTERS)]
    timings: dict[str, list[float]] = {name: [] for name, _ in settings}
    for step in range(num_steps * len(settings)):
        name, params = settings[step % len(settings)]
        chunks = [
            ScheduledChunk([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables, strict=True)
        ]
        rows = [SamplingRow.of_sequence(params, 1, s, PROMPT_LEN) for s in sequences]
        started = time.perf_counter()
        logits = runner.execute(chunks)
        picks = sampler.sample(logits, rows)
        timings[name].append(time.perf_counter() - started)
        for sequence, picked in zip(sequences, picks, strict=True):
            sequence.append(picked.token_id)
    off, on = statistics.median(timings["off"]), statistics.median(timings["on"])
    filters = statistics.median(timings["filters"])
    return {
        "streams": NUM_STREAMS,
        "steps_each": num_steps,
        "off_ms": round(off * 1000, 2),
        "on_ms": round(on * 1000, 2),
        "ratio": round(on / off, 3),
        "filters_ms": round(filters * 1000, 2),
        "filters_ratio": round(filters / off, 3),
    }


COUNTERS = {
    "prefill": ("prompt_tokens", "cached_prompt_tokens", "kv_sent_bytes"),
    "decode": ("kv_received_bytes", "shared_blocks"),
}


def _metrics_url(events: list[dict[str, Any]]) -> str:
    """An instance's ``/metrics`` URL, from its start-up log."""
    address = next(r["address"] for r in events if r.get("event") == "metrics_started")
    return f"http://{address}/metrics"


async def _counters(urls: dict[str, str]) -> dict[str, float]:
    """The `COUNTERS` of each role, from its instance's ``/metrics`` page."""
    counters: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10) as http:
        for role, url in urls.items():
            text = (await http.get(url)).text
            for name in COUNTERS[role]:
                counters[name] = sum(
                    s.value
                    for f in text_string_to_metric_families(text)
                    for s in f.samples
                    if s.name == f"pdserve_{role}_{name}_total"
                )
    return counters


async def _run_n(rest_url: str, metrics: dict[str, str], prompt: str, as_n: bool) -> dict[str, Any]:
    before = await _counters(metrics)
    body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0.8}
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=rest_url, timeout=300) as http:
        if as_n:
            responses = [await http.post("/v1/completions", json={**body, "n": 4, "seed": 1})]
        else:
            responses = await asyncio.gather(
                *(http.post("/v1/completions", json={**body, "seed": 1 + i}) for i in range(4))
            )
    elapsed = time.perf_counter() - started
    for response in responses:
        response.raise_for_status()
    after = await _counters(metrics)
    return {
        "seconds": round(elapsed, 3),
        **{name: after[name] - before[name] for name in after},
    }


def bench_n(model_dir: Path) -> dict[str, Any]:
    """n=4 vs 4 separate requests with one ~1,000-token prompt, each on a fresh prompt."""
    from pdserve.launcher.cluster import Cluster
    from pdserve.launcher.config import ClusterConfig

    log_dir = Path(tempfile.mkdtemp(prefix="bench-sampling-"))
    config = ClusterConfig(
        model=str(model_dir), port=0, grpc_port=0, internal_port=0, log_dir=str(log_dir)
    )
    cluster = Cluster(config)
    cluster.start()
    try:
        metrics = {
            "prefill": _metrics_url(cluster.prefills[0].events),
            "decode": _metrics_url(cluster.decodes[0].events),
        }

        def prompt(tag: str) -> str:
            return f"{tag}. " + " ".join(f"word{i % 97} sea{i % 13}" for i in range(330))

        asyncio.run(_run_n(cluster.rest_url, metrics, prompt("warm-up"), True))
        separate = asyncio.run(_run_n(cluster.rest_url, metrics, prompt("separate"), False))
        as_n = asyncio.run(_run_n(cluster.rest_url, metrics, prompt("as n"), True))
    finally:
        cluster.stop(timeout_s=20)
    return {
        "separate": separate,
        "n4": as_n,
        "computed_ratio": round(as_n["prompt_tokens"] / separate["prompt_tokens"], 3),
        "kv_bytes_ratio": round(as_n["kv_sent_bytes"] / separate["kv_sent_bytes"], 3),
        "kv_received_ratio": round(as_n["kv_received_bytes"] / separate["kv_received_bytes"], 3),
        "time_ratio": round(as_n["seconds"] / separate["seconds"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="decode steps per setting")
    parser.add_argument("--skip-n", action="store_true", help="only the decode-step bench")
    args = parser.parse_args()
    model_dir = resolve_model(DEFAULT_MODEL).path
    results: dict[str, Any] = {"model": DEFAULT_MODEL, "step": bench_step(model_dir, args.steps)}
    print("decode step:", results["step"])
    if not args.skip_n:
        results["n"] = bench_n(model_dir)
        print("n=4 vs 4 requests:", results["n"])
    print("results:", write_results("sampling", results))


if __name__ == "__main__":
    main()
