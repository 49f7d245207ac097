"""Load generation against an OpenAI-compatible ``/v1/completions`` endpoint, and its metrics.

A workload is a list of `RequestSpec`s (random-word prompts, exact output lengths, optional
Poisson arrival times). `run_load` sends them closed-loop at a fixed concurrency or open-loop at
their arrival times, streaming every completion and timing its chunks; `summarize` turns the
`RequestResult`s into percentiles and throughput. Used by bench/serve.py.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from common import percentile
from tqdm import tqdm

# NOTE: common English words; prompts are random sequences of them.
WORD_LIST = (
    "the of and to in is was for on are with as by at from his that be this have not but had "
    "they which or one you were all her she there would their we him been has when who will "
    "more no if out so said what up its about into than them can only other new some could "
    "time these two may then do first any my now such like our over man me even most made"
)
WORDS = tuple(WORD_LIST.split())
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload.

    Attributes:
        prompt: Text prompt.
        max_tokens: Tokens to generate (exactly: ``ignore_eos`` is set).
        arrival_s: Offset of its arrival from the start (open loop only).
    """

    prompt: str
    max_tokens: int
    arrival_s: float = 0.0


@dataclass
class RequestResult:
    """What one request measured (times in seconds)."""

    is_ok: bool
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    e2e_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


def parse_range(text: str) -> tuple[int, int]:
    """``"LO:HI"`` or ``"N"`` as an inclusive integer range."""
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 < LO <= HI, got {text!r}")
    return low, high


def make_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    request_rate: float | None,
    seed: int,
) -> list[RequestSpec]:
    """`num_requests` requests; Poisson arrival offsets when `request_rate` is set."""
    rng = random.Random(seed)
    specs, arrival_s = [], 0.0
    for _ in range(num_requests):
        length = rng.randint(*prompt_len)
        words: list[str] = []
        while sum(len(w) + 1 for w in words) < length:
            words.append(rng.choice(WORDS))
        prompt = " ".join(words)[:length]
        if request_rate:
            arrival_s += rng.expovariate(request_rate)
        specs.append(RequestSpec(prompt, rng.randint(*output_len), arrival_s))
    return specs


def completion_body(model: str, spec: RequestSpec) -> dict[str, Any]:
    """The streamed, greedy ``/v1/completions`` body of `spec` (exactly its tokens)."""
    return {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


async def send(
    http: httpx.AsyncClient, model: str, spec: RequestSpec, timeout_s: float
) -> RequestResult:
    """Streams one completion and times its chunks."""
    body = completion_body(model, spec)
    start = time.perf_counter()
    token_times: list[tuple[float, int]] = []
    usage: dict[str, Any] = {}
    try:
        async with http.stream("POST", "/v1/completions", json=body, timeout=timeout_s) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                return RequestResult(is_ok=False, error=f"HTTP {reply.status_code}: {text[:200]}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return RequestResult(is_ok=False, error=str(data["error"])[:200])
                usage = data.get("usage") or usage
                for choice in data.get("choices", []):
                    ids = choice.get("token_ids")
                    num = len(ids) if ids is not None else int(bool(choice.get("text")))
                    if num:
                        token_times.append((time.perf_counter(), num))
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        return RequestResult(is_ok=False, error=repr(error)[:200])
    if not token_times:
        return RequestResult(is_ok=False, error="no tokens")
    num_output = int(usage.get("completion_tokens") or sum(n for _, n in token_times))
    first, last = token_times[0][0], token_times[-1][0]
    itl: list[float] = []
    for (previous, _), (now, num) in itertools.pairwise(token_times):
        itl.extend([(now - previous) / num] * num)
    return RequestResult(
        is_ok=True,
        num_prompt_tokens=int(usage.get("prompt_tokens") or 0),
        num_output_tokens=num_output,
        ttft_s=first - start,
        tpot_s=(last - first) / (num_output - 1) if num_output > 1 else math.nan,
        e2e_s=last - start,
        itl_s=itl,
    )


async def run_load(
    url: str,
    model: str,
    specs: list[RequestSpec],
    *,
    concurrency: int | None,
    request_rate: float | None,
    timeout_s: float = 600.0,
    label: str = "",
) -> tuple[list[RequestResult], float]:
    """Sends `specs` closed-loop at `concurrency` or at their Poisson arrival times.

    Returns:
        The results in request order and the run's wall time in seconds.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    results: list[RequestResult | None] = [None] * len(specs)
    progress = tqdm(total=len(specs), desc=label or url, unit="req", leave=False)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout_s) as http:
        start = time.perf_counter()
        if request_rate:

            async def arrive(index: int, spec: RequestSpec) -> None:
                await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - start)))
                results[index] = await send(http, model, spec, timeout_s)
                progress.update()

            await asyncio.gather(*(arrive(i, s) for i, s in enumerate(specs)))
        else:
            next_index = 0

            async def worker() -> None:
                nonlocal next_index
                while next_index < len(specs):
                    index, next_index = next_index, next_index + 1
                    results[index] = await send(http, model, specs[index], timeout_s)
                    progress.update()

            await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
        duration_s = time.perf_counter() - start
    progress.close()
    return [r for r in results if r is not None], duration_s


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    """Percentiles (ms) of TTFT, TPOT, ITL and end-to-end latency; throughput; errors."""
    ok = [r for r in results if r.is_ok]
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "num_errors": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.is_ok})[:5],
        "duration_s": round(duration_s, 3),
        "output_tokens_per_s": round(sum(r.num_output_tokens for r in ok) / duration_s, 2),
        "requests_per_s": round(len(ok) / duration_s, 3),
        "mean_prompt_tokens": round(statistics.fmean(r.num_prompt_tokens for r in ok), 1)
        if ok
        else 0,
    }
    samples = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [r.tpot_s for r in ok if not math.isnan(r.tpot_s)],
        "itl": [x for r in ok for x in r.itl_s],
        "e2e": [r.e2e_s for r in ok],
    }
    for name, values in samples.items():
        for q in PERCENTILES:
            key = f"{name}_p{q}_ms"
            summary[key] = round(percentile(values, q) * 1000, 2) if values else None
    return summary
