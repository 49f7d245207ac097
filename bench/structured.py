"""What structured outputs cost, on the default model (SmolLM2-135M-Instruct), as ratios
measured in one run.

``step``: the decode step (a batched forward pass over the paged cache, each row's constraint
mask, then sampling) with 16 streams, each under the same JSON schema (its own matcher) vs
unconstrained. The two settings alternate step by step on the same batch, so drift hits both
alike; a stream whose JSON is complete starts a fresh matcher.

``compile``: 16 streams run through gateway, prefill and decode processes while a request
with a new, large schema (50 properties, nested objects and arrays) arrives; the inter-token
latency p99 of the 16 streams beside it vs beside the same request without a schema (what
the schema's compilation adds: the request's own prefill shares the CPUs either way) and vs
the 16 alone, and both requests' time to first token. The schema is compiled on the
instances' compiler threads, never on the engine thread. Run:

    .venv/bin/python bench/structured.py [--steps 40] [--skip-compile]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from common import prefilled_streams, write_results

from pdserve.common.generation import Constraint, ConstraintKind, SamplingParams
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.constraints import ConstraintCompiler, ConstraintState
from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model
from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.tokenizer.tokenizer import Tokenizer

NUM_STREAMS = 16
PROMPT_LEN = 256
BLOCK_SIZE = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
        },
        "status": {"enum": ["active", "inactive", "pending"]},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "status", "score"],
}


def large_schema(tag: str) -> dict[str, Any]:
    """50 properties, a third of them nested objects or arrays of objects; `tag` makes the
    schema new to every cache."""
    properties: dict[str, Any] = {}
    for i in range(50):
        if i % 3 == 0:
            properties[f"{tag}_obj_{i}"] = {
                "type": "object",
                "properties": {f"f{j}": {"type": "string"} for j in range(4)},
                "required": [f"f{j}" for j in range(4)],
            }
        elif i % 3 == 1:
            properties[f"{tag}_list_{i}"] = {
                "type": "array",
                "items": {"type": "object", "properties": {"v": {"type": "integer"}}},
            }
        else:
            properties[f"{tag}_value_{i}"] = {"enum": [f"{tag}-{i}-{k}" for k in range(5)]}
    return {"type": "object", "properties": properties, "required": sorted(properties)}


def bench_step(model_dir: Path, num_steps: int) -> dict[str, Any]:
    """Median decode-step time (forward, masks, sampling) unconstrained vs constrained."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    runner, sequences, tables = prefilled_streams(
        model_dir, NUM_STREAMS, PROMPT_LEN, num_steps * 2, BLOCK_SIZE
    )
    eos = tokenizer.eos_token_ids
    sampler = Sampler(eos)
    compiler = ConstraintCompiler(tokenizer.tokenizer_json, eos)
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    off = SamplingParams(temperature=0.8, seed=1, max_tokens=4096)
    on = SamplingParams(temperature=0.8, seed=1, max_tokens=4096, constraint=constraint)
    states: list[ConstraintState] = [compiler.start(constraint) for _ in sequences]
    completions: list[list[int]] = [[] for _ in sequences]
    num_restarts = 0
    timings: dict[str, list[float]] = {"off": [], "on": []}
    for step in range(num_steps * 2):
        is_on = step % 2 == 1
        chunks = [
            ScheduledChunk([s[-1]], len(s) - 1, t) for s, t in zip(sequences, tables, strict=True)
        ]
        started = time.perf_counter()
        logits = runner.execute(chunks)
        if is_on:
            rows = [
                SamplingRow(on, 1, len(c), token_mask=state.mask(c))
                for state, c in zip(states, completions, strict=True)
            ]
        else:
            rows = [SamplingRow(off, 1, len(s) - PROMPT_LEN) for s in sequences]
        picks = sampler.sample(logits, rows)
        timings["on" if is_on else "off"].append(time.perf_counter() - started)
        for i, picked in enumerate(picks):
            sequences[i].append(picked.token_id)
            if is_on:
                if picked.token_id in eos:  # a whole JSON value: a fresh one
                    states[i], completions[i] = compiler.start(constraint), []
                    num_restarts += 1
                else:
                    completions[i].append(picked.token_id)
    compiler.close()
    off_s, on_s = statistics.median(timings["off"]), statistics.median(timings["on"])
    return {
        "streams": NUM_STREAMS,
        "steps_each": num_steps,
        "off_ms": round(off_s * 1000, 2),
        "on_ms": round(on_s * 1000, 2),
        "ratio": round(on_s / off_s, 3),
        "json_values_completed": num_restarts,
    }


async def _stream(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, list[float]]:
    """(time to first token, inter-token gaps) of one streamed chat completion."""
    started = time.perf_counter()
    arrivals: list[float] = []
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return (arrivals[0] - started if arrivals else float("nan")), gaps


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else float("nan")


async def _round(rest_url: str, extra: str) -> dict[str, Any]:
    """16 streams, and (`extra` "plain" or "schema") one more request 1.5 s in."""
    streams = [
        {"model": DEFAULT_MODEL, "max_tokens": 96, "temperature": 0.8, "seed": i,
         "ignore_eos": True,
         "messages": [{"role": "user", "content": f"Tell story number {i} about the sea."}]}
        for i in range(NUM_STREAMS)
    ]  # fmt: skip
    large = {
        "model": DEFAULT_MODEL, "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": "Fill in the form."}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "form", "schema": large_schema(uuid.uuid4().hex[:8])}},
    }  # fmt: skip
    async with httpx.AsyncClient(base_url=rest_url, timeout=300) as http:
        tasks = [asyncio.create_task(_stream(http, body)) for body in streams]
        large_ttft = None
        if extra:
            await asyncio.sleep(1.5)  # the 16 are decoding
            if extra == "plain":
                del large["response_format"]
            large_ttft, _ = await _stream(http, large)
        results = await asyncio.gather(*tasks)
    gaps = [gap for _, stream_gaps in results for gap in stream_gaps]
    return {"itl_p99_ms": _p99(gaps) * 1000, "large_ttft_ms": (large_ttft or 0) * 1000}


def bench_compile(model_dir: Path, num_rounds: int) -> dict[str, Any]:
    from pdserve.launcher.cluster import Cluster
    from pdserve.launcher.config import ClusterConfig

    log_dir = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    config = ClusterConfig(
        model=str(model_dir), port=0, grpc_port=0, internal_port=0, log_dir=str(log_dir)
    )
    cluster = Cluster(config)
    cluster.start()
    p99: dict[str, list[float]] = {"": [], "plain": [], "schema": []}
    ttfts: dict[str, list[float]] = {"plain": [], "schema": []}
    try:
        asyncio.run(_round(cluster.rest_url, "schema"))  # warm-up
        for _ in range(num_rounds):
            for extra in ("", "plain", "schema"):
                result = asyncio.run(_round(cluster.rest_url, extra))
                p99[extra].append(result["itl_p99_ms"])
                if extra:
                    ttfts[extra].append(result["large_ttft_ms"])
    finally:
        cluster.stop(timeout_s=20)
    alone, plain, schema = (statistics.median(p99[k]) for k in ("", "plain", "schema"))
    return {
        "rounds": num_rounds,
        "itl_p99_alone_ms": round(alone, 1),
        "itl_p99_with_plain_request_ms": round(plain, 1),
        "itl_p99_with_large_schema_ms": round(schema, 1),
        "ratio_vs_plain_request": round(schema / plain, 3),
        "ratio_vs_alone": round(schema / alone, 3),
        "plain_request_ttft_ms": round(statistics.median(ttfts["plain"]), 1),
        "large_schema_ttft_ms": round(statistics.median(ttfts["schema"]), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="decode steps per setting")
    parser.add_argument("--rounds", type=int, default=3, help="compile rounds (each setting)")
    parser.add_argument("--skip-compile", action="store_true", help="only the decode-step bench")
    args = parser.parse_args()
    model_dir = resolve_model(DEFAULT_MODEL).path
    results: dict[str, Any] = {"model": DEFAULT_MODEL, "step": bench_step(model_dir, args.steps)}
    print("decode step:", results["step"])
    if not args.skip_compile:
        results["compile"] = bench_compile(model_dir, args.rounds)
        print("large schema beside 16 streams:", results["compile"])
    print("results:", write_results("structured", results))


if __name__ == "__main__":
    main()
