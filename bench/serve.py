"""Serving benchmark: pdserve vs the colocated engine, or any OpenAI-compatible endpoint.

Load generation (bench/loadgen.py) against any ``/v1/completions`` endpoint, and a mode that
starts pdserve and the colocated engine and runs the same workload on both in one run.

    # one endpoint (pdserve's gateway, vLLM, ...): closed loop at a fixed concurrency
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000 --model demo-llama-v1 \\
        --concurrency 8 --num-requests 64
    # or open loop: Poisson arrivals at 4 requests/s
    .venv/bin/python bench/serve.py --url http://127.0.0.1:8000 --model demo-llama-v1 \\
        --request-rate 4
    # pdserve (launcher: gateway + 1 prefill + 1 decode) vs bench/colocated_server.py
    .venv/bin/python bench/serve.py --compare [--model-preset mid|demo|smollm2] [--rounds 2]
    # the same on one GPU: every engine on it, each with its own fixed KV cache
    .venv/bin/python bench/serve.py --compare --model-preset smollm2 --device cuda \\
        --dtype bfloat16 --num-blocks 4096

Workload: prompts of random words with a length drawn uniformly from ``--prompt-len LO:HI``
(characters: tokens for the demo tokenizer, which is byte-level), outputs drawn uniformly from
``--output-len LO:HI`` tokens, greedy, ``ignore_eos`` so every request produces exactly its
length; the same seed gives the same requests to every endpoint.

Per request, from the streamed chunks: TTFT (send to first token), TPOT ((last token - first
token) / (tokens - 1)), ITL (gap between consecutive token-carrying chunks, split evenly over
the tokens a chunk carries), end-to-end latency. Per run: p50/p90/p99 of each, output tokens/s,
requests/s, errors. ``--compare`` alternates the endpoints round by round (both stay up; the
idle one sleeps) and reports medians over rounds and ratios pdserve / colocated. Against
pdserve (``--compare``, or a ``--url`` that is a pdserve gateway) it also prints where the time
to first token went: the mean per phase from the gateway's ``/metrics``, scraped around each
round (bench/ttft_breakdown.py), next to the measured TTFT. Results go to
bench/results/serve-<time>.json and .png (CDFs and throughput per round).

Threads: pdserve's prefill and decode get ``--pd-threads`` torch threads each (OMP_NUM_THREADS),
the colocated engine ``--colocated-threads``; both default to 1 (on a 2-core machine that is
shared with the load generator, 2 threads made the colocated engine slower, not faster).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from common import build_random_llama, server_logs, write_results
from loadgen import (
    PERCENTILES,
    RequestResult,
    RequestSpec,
    make_workload,
    parse_range,
    run_load,
    summarize,
)
from ttft_breakdown import PhaseRound, difference, report, scrape

BENCH_DIR = Path(__file__).resolve().parent


# ---- the two servers of --compare -------------------------------------------------------------


def demo_model_dir() -> Path:
    from pdserve.engine.demo import ensure_demo_model

    return ensure_demo_model()


def smollm2_model_dir() -> Path:
    from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL).path


def mid_model_dir() -> Path:
    """A random Llama (8 layers, hidden 512, 8 heads / 4 KV heads) with the demo tokenizer."""
    from pdserve.common.env import cache_dir

    demo = demo_model_dir()
    path = cache_dir() / "bench-mid-llama-v1"
    if (path / "tokenizer.json").is_file():
        return path
    tmp = Path(tempfile.mkdtemp(prefix="bench-mid-", dir=cache_dir()))
    build_random_llama(tmp, vocab_size=json.loads((demo / "config.json").read_text())["vocab_size"])
    demo_config = json.loads((demo / "config.json").read_text())
    for name in ("config.json", "generation_config.json"):
        config = json.loads((tmp / name).read_text())
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            config[key] = demo_config[key]
        (tmp / name).write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, tmp / name)
    with contextlib.suppress(OSError):
        tmp.rename(path)  # NOTE: atomic; a concurrent builder may have won the race
    return path if path.is_dir() else tmp


@contextlib.contextmanager
def pdserve_cluster(
    model: Path, threads: int, log_dir: Path, engine_args: Sequence[str] = ()
) -> Iterator[str]:
    """gateway + 1 prefill + 1 decode as processes (the launcher), each engine with
    `engine_args` (``--device cuda``, ...); yields the REST URL."""
    from pdserve.launcher.cluster import Cluster
    from pdserve.launcher.config import ClusterConfig

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    flags = " ".join(engine_args)
    config = ClusterConfig(
        model=str(model),
        port=0,
        grpc_port=0,
        internal_port=0,
        log_dir=str(log_dir),
        prefill_args=flags,
        decode_args=flags,
    )
    cluster = Cluster(config, env=env)
    cluster.start()
    try:
        yield cluster.rest_url
    finally:
        cluster.stop(timeout_s=20)


@contextlib.contextmanager
def colocated_server(
    model: Path, threads: int, log_dir: Path, extra_args: Sequence[str] = ()
) -> Iterator[str]:
    """bench/colocated_server.py as a process (with `extra_args`); yields its URL."""
    log = (log_dir / "colocated.log").open("w")
    process = subprocess.Popen(
        [sys.executable, str(BENCH_DIR / "colocated_server.py"), "--model", str(model),
         "--num-threads", str(threads), *extra_args],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], 120)
        line = process.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the colocated server did not start; see {log.name}")
        yield f"http://127.0.0.1:{json.loads(line)['port']}"
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def served_model(url: str) -> str:
    """The first model an endpoint lists."""
    return str(httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"])


# ---- output ----------------------------------------------------------------------------------


def print_table(summaries: dict[str, dict[str, Any]]) -> None:
    names = list(summaries)
    rows = [
        ("output tok/s", "output_tokens_per_s"),
        ("requests/s", "requests_per_s"),
        *(
            (f"{metric.upper()} p{q} (ms)", f"{metric}_p{q}_ms")
            for metric in ("ttft", "tpot", "itl", "e2e")
            for q in PERCENTILES
        ),
        ("errors", "num_errors"),
    ]
    header = f"{'metric':<18}" + "".join(f"{name:>14}" for name in names)
    if len(names) == 2:
        header += f"{'ratio':>10}"
    print(header)
    for title, key in rows:
        values = [summaries[name].get(key) for name in names]
        line = f"{title:<18}" + "".join(f"{_fmt(v):>14}" for v in values)
        if len(names) == 2 and all(isinstance(v, int | float) and v for v in values):
            line += f"{values[0] / values[1]:>10.2f}"
        print(line)


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:,.2f}" if isinstance(value, float) else str(value)


def plot(
    runs: dict[str, list[list[RequestResult]]], throughput: dict[str, list[float]], path: Path
) -> None:
    """CDFs of TTFT, TPOT and ITL per endpoint, and output throughput per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    metrics = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("itl", "inter-token latency (ms)"))
    for ax, (metric, title) in zip(axes.flat, metrics, strict=False):
        for name, rounds in runs.items():
            values = sorted(
                1000 * v
                for results in rounds
                for r in results
                if r.is_ok
                for v in (r.itl_s if metric == "itl" else [getattr(r, f"{metric}_s")])
                if not math.isnan(v)
            )
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of samples")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax = axes.flat[3]
    width = 0.8 / max(1, len(throughput))
    num_rounds = max((len(values) for values in throughput.values()), default=0)
    for i, (name, values) in enumerate(throughput.items()):
        ax.bar([r + i * width for r in range(len(values))], values, width, label=name)
    ax.set_xticks([r + width * (len(throughput) - 1) / 2 for r in range(num_rounds)])
    ax.set_xticklabels([str(r + 1) for r in range(num_rounds)])
    ax.set_xlabel("round")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# ---- main ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of an OpenAI-compatible server")
    target.add_argument(
        "--compare", action="store_true", help="start pdserve and the colocated engine"
    )
    parser.add_argument("--model", help="model name to request (default: the first listed)")
    parser.add_argument(
        "--model-preset",
        choices=("mid", "demo", "smollm2"),
        default="mid",
        help="--compare: mid = random 8-layer hidden-512 Llama, demo = the tiny demo model, "
        "smollm2 = SmolLM2-135M-Instruct (the default real model)",
    )
    parser.add_argument("--model-dir", help="--compare: serve this model directory instead")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    load.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals per s")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--prompt-len", type=parse_range, default=(64, 512), help="LO:HI chars")
    parser.add_argument("--output-len", type=parse_range, default=(32, 128), help="LO:HI tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="--compare: rounds per endpoint")
    parser.add_argument(
        "--pd-threads", type=int, default=1, help="--compare: torch threads per pdserve engine"
    )
    parser.add_argument(
        "--colocated-threads",
        type=int,
        default=1,
        help="--compare: torch threads of the colocated engine (1 beat 2 on a 2-core machine)",
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    parser.add_argument(
        "--device", default="cpu", help="--compare: torch device of every engine, e.g. cuda"
    )
    parser.add_argument("--dtype", default="float32", help="--compare: e.g. bfloat16 on a GPU")
    parser.add_argument(
        "--num-blocks",
        type=int,
        help="--compare: KV blocks of every engine (set it on a GPU the engines share)",
    )
    return parser


def run_one_endpoint(args: argparse.Namespace, specs: list[RequestSpec]) -> dict[str, Any]:
    model = args.model or served_model(args.url)
    before = scrape(args.url)  # None unless the endpoint is a pdserve gateway
    results, duration_s = asyncio.run(
        run_load(
            args.url,
            model,
            specs,
            concurrency=None if args.request_rate else args.concurrency,
            request_rate=args.request_rate,
            timeout_s=args.timeout_s,
        )
    )
    summary = summarize(results, duration_s)
    print_table({args.url: summary})
    after = scrape(args.url) if before is not None else None
    breakdown = None
    if before is not None and after is not None:
        breakdown = report([PhaseRound(difference(before, after), results)])
    return {
        "url": args.url,
        "model": model,
        "summary": summary,
        "ttft_breakdown": breakdown,
        "_runs": {args.url: [results]},
        "_throughput": {args.url: [summary["output_tokens_per_s"]]},
    }


def run_compare(args: argparse.Namespace, specs: list[RequestSpec]) -> dict[str, Any]:
    with server_logs("bench-serve-logs-") as logs:
        return compare(args, specs, logs)


def compare(args: argparse.Namespace, specs: list[RequestSpec], log_dir: Path) -> dict[str, Any]:
    """`run_compare`'s rounds, with the servers' logs in `log_dir`."""
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        presets = {"mid": mid_model_dir, "demo": demo_model_dir, "smollm2": smollm2_model_dir}
        model_dir = presets[args.model_preset]()
    warmup = make_workload(4, args.prompt_len, (8, 8), None, args.seed + 1)
    runs: dict[str, list[list[RequestResult]]] = {"pdserve": [], "colocated": []}
    summaries: dict[str, list[dict[str, Any]]] = {"pdserve": [], "colocated": []}
    phase_rounds: list[PhaseRound] = []  # what pdserve's gateway observed in each round
    # NOTE: on one GPU the three engines must not each size their cache from free memory.
    engine_args = ["--device", args.device, "--dtype", args.dtype]
    if args.num_blocks is not None:
        engine_args += ["--num-blocks", str(args.num_blocks)]
    with (
        pdserve_cluster(model_dir, args.pd_threads, log_dir, engine_args) as pd_url,
        colocated_server(model_dir, args.colocated_threads, log_dir, engine_args) as colocated_url,
    ):
        urls = {"pdserve": pd_url, "colocated": colocated_url}
        models = {name: args.model or served_model(url) for name, url in urls.items()}
        for name, url in urls.items():
            asyncio.run(run_load(url, models[name], warmup, concurrency=4, request_rate=None))
        for round_index in range(args.rounds):
            # NOTE: alternate which endpoint goes first, so drift on a noisy machine is shared.
            order = list(urls) if round_index % 2 == 0 else list(reversed(urls))
            for name in order:
                before = scrape(urls[name]) if name == "pdserve" else None
                results, duration_s = asyncio.run(
                    run_load(
                        urls[name],
                        models[name],
                        specs,
                        concurrency=None if args.request_rate else args.concurrency,
                        request_rate=args.request_rate,
                        timeout_s=args.timeout_s,
                        label=f"{name} round {round_index + 1}",
                    )
                )
                runs[name].append(results)
                summaries[name].append(summarize(results, duration_s))
                if before is not None and (after := scrape(urls[name])) is not None:
                    phase_rounds.append(PhaseRound(difference(before, after), results))
                print(
                    f"round {round_index + 1} {name}: "
                    f"{summaries[name][-1]['output_tokens_per_s']} output tok/s, "
                    f"{summaries[name][-1]['num_errors']} errors",
                    flush=True,
                )
    merged = {
        name: {
            **summarize(
                [r for results in runs[name] for r in results],
                sum(s["duration_s"] for s in summaries[name]),
            ),
            "output_tokens_per_s": statistics.median(
                s["output_tokens_per_s"] for s in summaries[name]
            ),
            "requests_per_s": statistics.median(s["requests_per_s"] for s in summaries[name]),
        }
        for name in runs
    }
    print_table(merged)
    breakdown = report(phase_rounds, runs["colocated"], "colocated") if phase_rounds else None
    return {
        "model_dir": model_dir.name,
        "pd_threads": args.pd_threads,
        "colocated_threads": args.colocated_threads,
        "merged": merged,
        "rounds": summaries,
        "ttft_breakdown": breakdown,
        "ratios_pdserve_over_colocated": {
            key: round(merged["pdserve"][key] / merged["colocated"][key], 3)
            for key in merged["pdserve"]
            if key.endswith(("_ms", "_per_s"))
            and merged["pdserve"][key]
            and merged["colocated"][key]
        },
        "_runs": runs,
        "_throughput": {name: [s["output_tokens_per_s"] for s in summaries[name]] for name in runs},
    }


def main() -> None:
    args = build_parser().parse_args()
    specs = make_workload(
        args.num_requests, args.prompt_len, args.output_len, args.request_rate, args.seed
    )
    settings = {key: value for key, value in vars(args).items() if key not in ("url", "compare")}
    results = run_compare(args, specs) if args.compare else run_one_endpoint(args, specs)
    runs, throughput = results.pop("_runs"), results.pop("_throughput")
    results = {"command": " ".join(sys.argv[1:]), "settings": settings, **results}
    path = write_results("serve", results)
    plot(runs, throughput, path.with_suffix(".png"))
    print(f"results: {path} and {path.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
