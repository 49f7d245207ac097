"""Prefix cache: TTFT of multi-turn chat and of a shared system prompt, cache on vs off, one run.

    .venv/bin/python bench/prefix_cache.py                       # SmolLM2-135M-Instruct
    .venv/bin/python bench/prefix_cache.py --conversations 4 --turns 3 --system-requests 6

Two clusters run the default real model as `pdserve up` does (gateway + 1 prefill + 1
decode): one as is (the prefill's prefix cache is on by default) and one with
``--prefill-args --no-prefix-cache``. Both stay up; the workloads alternate between them, so
both see the same machine. Every request is a streamed chat completion through the OpenAI SDK,
greedy, one at a time; TTFT is the time from sending to the first content chunk.

* multi-turn chat: ``--conversations`` conversations of ``--turns`` turns; each turn appends a
  user message of about 60 words and the model's own previous answer (``--max-tokens``), so
  every turn's prompt extends the previous one;
* shared system prompt: ``--system-requests`` requests with the same ~1,000-token system
  prompt and different short questions.

Reported: TTFT p50 and p90 per workload and cluster, and the ratio no-cache / cache (the
speed-up). Multi-turn rows count turns 2 and later (turn 1 has nothing to reuse) and, apart,
all turns. Results go to bench/results/prefix_cache-<time>.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
from common import write_results

from pdserve.launcher.cluster import Cluster
from pdserve.launcher.config import ClusterConfig

WORDS = [
    "river",
    "mountain",
    "signal",
    "quiet",
    "orange",
    "market",
    "window",
    "garden",
    "engine",
    "paper",
    "silver",
    "morning",
    "letter",
    "bridge",
    "winter",
    "candle",
    "forest",
    "harbor",
    "pocket",
    "thunder",
    "meadow",
    "lantern",
    "copper",
]


def sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words)).capitalize() + "."


def start(name: str, model: str, prefill_args: str, log_root: Path) -> Cluster:
    config = ClusterConfig(
        model=model, port=0, grpc_port=0, internal_port=0, prefill_args=prefill_args,
        log_dir=str(log_root / name), startup_timeout_s=300,
    )  # fmt: skip
    cluster = Cluster(config)
    cluster.start()
    return cluster


def ttft(
    client: openai.OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[float, str]:
    """Seconds to the first content chunk, and the whole answer."""
    began = time.perf_counter()
    first = None
    text = []
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - began
            text.append(chunk.choices[0].delta.content)
    return (first if first is not None else time.perf_counter() - began), "".join(text)


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": round(1000 * statistics.median(ordered), 1),
        "p90_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 1),
        "n": len(ordered),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    log_root = Path(tempfile.mkdtemp(prefix="bench-prefix-logs-"))
    clusters = {
        "cache": start("cache", args.model, "", log_root),
        "no_cache": start("no-cache", args.model, "--no-prefix-cache", log_root),
    }
    try:
        clients = {
            name: openai.OpenAI(base_url=f"{c.rest_url}/v1", api_key="unused", max_retries=0)
            for name, c in clusters.items()
        }
        model = next(m.id for m in clients["cache"].models.list())
        ttfts: dict[str, dict[str, list[float]]] = {
            name: {"turn1": [], "later": [], "system": []} for name in clusters
        }
        rng = random.Random(0)
        conversations = [
            [sentence(rng, 60) for _ in range(args.turns)] for _ in range(args.conversations)
        ]
        for index, user_turns in enumerate(conversations):
            for name in sorted(clusters, key=lambda n: (n == "cache") ^ (index % 2 == 0)):
                messages: list[dict[str, str]] = []
                for turn, user in enumerate(user_turns):
                    messages.append({"role": "user", "content": user})
                    seconds, answer = ttft(clients[name], model, messages, args.max_tokens)
                    ttfts[name]["turn1" if turn == 0 else "later"].append(seconds)
                    messages.append({"role": "assistant", "content": answer})
            print(f"conversation {index + 1}/{len(conversations)} done", flush=True)
        system = " ".join(sentence(rng, 12) for _ in range(75))  # about 1,000 tokens
        for index in range(args.system_requests):
            question = f"Question {index}: {sentence(rng, 8)}"
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            for name in sorted(clusters, key=lambda n: (n == "cache") ^ (index % 2 == 0)):
                seconds, _ = ttft(clients[name], model, messages, 8)
                ttfts[name]["system"].append(seconds)
    finally:
        for cluster in clusters.values():
            cluster.stop(timeout_s=20)
    rows = {}
    for workload in ("later", "turn1", "system"):
        cache, off = (percentiles(ttfts[n][workload]) for n in ("cache", "no_cache"))
        rows[workload] = {
            "cache": cache,
            "no_cache": off,
            "p50_speedup": round(off["p50_ms"] / cache["p50_ms"], 2),
            "p90_speedup": round(off["p90_ms"] / cache["p90_ms"], 2),
        }
        print(
            f"{workload:>7}: TTFT p50 {cache['p50_ms']:.0f} ms (cache) vs {off['p50_ms']:.0f} ms "
            f"(no cache), x{rows[workload]['p50_speedup']}; p90 {cache['p90_ms']:.0f} vs "
            f"{off['p90_ms']:.0f} ms, x{rows[workload]['p90_speedup']}",
            flush=True,
        )
    all_turns = {
        name: percentiles(ttfts[name]["turn1"] + ttfts[name]["later"]) for name in clusters
    }
    return {"command": " ".join(sys.argv[1:]), "model": args.model, "rows": rows,
            "all_turns": all_turns, "raw": ttfts}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--system-requests", type=int, default=20)
    results = run(parser.parse_args())
    print(f"results: {write_results('prefix_cache', results)}")


if __name__ == "__main__":
    main()
