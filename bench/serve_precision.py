"""Serving benchmark per dtype and quantization: one pdserve cluster each, in the same run.

    python bench/serve_precision.py                       # SmolLM2 (the default model) on CPU
    python bench/serve_precision.py --settings float32 bfloat16 bfloat16+int8 --rounds 2
    python bench/serve_precision.py --settings bfloat16 bfloat16+deterministic --concurrency 16

Each setting (``DTYPE[+QUANTIZATION][+deterministic]``) is a gateway + 1 prefill + 1 decode
(the launcher, bench/serve.py's `pdserve_cluster`), all up at once; every round runs the same
closed-loop workload (bench/loadgen.py) against each in turn, the order rotating from round to
round so that drift on a noisy machine is shared. Reported: medians over rounds of output
tokens/s and p50 TTFT / TPOT per setting, and their ratios to float32 and to bfloat16, from the
same rounds, and every setting's tokens/s, TTFT and TPOT as ratios to the first setting's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import cpu_description, write_results
from loadgen import make_workload, parse_range, run_load, summarize
from serve import pdserve_cluster, served_model, smollm2_model_dir

METRICS = ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms")


def parse_setting(text: str) -> tuple[str, str, str]:
    """``bfloat16+int8`` -> (``bfloat16``, ``int8``, ``""``); ``float32`` -> (``float32``,
    ``none``, ``""``); ``bfloat16+deterministic`` -> (``bfloat16``, ``none``,
    ``deterministic``): batch-invariant numerics on both engines."""
    dtype, *rest = text.split("+")
    mode = "deterministic" if "deterministic" in rest else ""
    quantization = next((part for part in rest if part != "deterministic"), "none")
    return dtype, quantization, mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["float32", "bfloat16", "bfloat16+int8", "bfloat16+int4"],
        help="DTYPE[+QUANTIZATION] per cluster",
    )
    parser.add_argument("--model-dir", type=Path, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument(
        "--kv-cache-memory-mb", type=int, default=512, help="KV cache of every engine"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--prompt-len", type=parse_range, default=(64, 512), help="LO:HI chars")
    parser.add_argument("--output-len", type=parse_range, default=(32, 96), help="LO:HI tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = [parse_setting(text) for text in args.settings]
    model_dir = args.model_dir or smollm2_model_dir()
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']}, flags: {' '.join(cpu['flags'])}")
    specs = make_workload(args.num_requests, args.prompt_len, args.output_len, None, args.seed)
    warmup = make_workload(4, args.prompt_len, (8, 8), None, args.seed + 1)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-serve-precision-"))
    summaries: dict[tuple[str, str, str], list[dict[str, Any]]] = {key: [] for key in settings}
    with contextlib.ExitStack() as stack:
        urls = {
            key: stack.enter_context(
                pdserve_cluster(
                    model_dir,
                    args.threads,
                    log_dir / "-".join(part for part in key if part),
                    [
                        *("--dtype", key[0], "--quantization", key[1]),
                        *(["--deterministic"] if key[2] else []),
                        *("--kv-cache-memory-mb", str(args.kv_cache_memory_mb)),
                    ],
                )
            )
            for key in settings
        }
        models = {key: served_model(url) for key, url in urls.items()}
        for key, url in urls.items():
            asyncio.run(run_load(url, models[key], warmup, concurrency=4, request_rate=None))
        for round_index in range(args.rounds):
            shift = round_index % len(settings)
            for key in settings[shift:] + settings[:shift]:
                results, duration_s = asyncio.run(
                    run_load(
                        urls[key],
                        models[key],
                        specs,
                        concurrency=args.concurrency,
                        request_rate=None,
                        label=f"{'+'.join(p for p in key if p)} round {round_index + 1}",
                    )
                )
                summaries[key].append(summarize(results, duration_s))
    medians = {
        key: {m: statistics.median(s[m] for s in rounds) for m in METRICS}
        for key, rounds in summaries.items()
    }
    rows = []
    print(
        f"\n{next(iter(models.values()))}, {args.threads} thread(s) per engine, concurrency "
        f"{args.concurrency}, {args.num_requests} requests, {args.rounds} rounds\n"
    )
    first = medians[settings[0]]
    print(
        "| setting | output tok/s | TTFT p50 ms | TPOT p50 ms | tok/s vs fp32 | tok/s vs bf16 "
        f"| tok/s, TTFT, TPOT vs {'+'.join(p for p in settings[0] if p)} |"
    )
    print("|---|---|---|---|---|---|---|")
    for key, values in medians.items():
        row: dict[str, Any] = {
            "dtype": key[0],
            "quantization": key[1],
            "deterministic": bool(key[2]),
            **values,
        }
        for base in (("float32", "none", ""), ("bfloat16", "none", "")):
            if base in medians:
                ratio = values["output_tokens_per_s"] / medians[base]["output_tokens_per_s"]
                row[f"throughput_vs_{base[0]}"] = ratio
        against_first = {m: values[m] / first[m] for m in METRICS}
        row["vs_first_setting"] = against_first
        rows.append(row)
        print(
            f"| {'+'.join(p for p in key if p)} | {values['output_tokens_per_s']:.1f} | "
            f"{values['ttft_p50_ms']:.0f} | {values['tpot_p50_ms']:.1f} | "
            f"{_ratio(row.get('throughput_vs_float32'))} | "
            f"{_ratio(row.get('throughput_vs_bfloat16'))} | "
            + ", ".join(f"{against_first[m]:.2f}x" for m in METRICS)
            + " |"
        )
    path = write_results(
        "serve_precision",
        {"settings": {**vars(args), "model_dir": str(model_dir), **cpu}, "rows": rows},
    )
    print(f"\nresults: {path}")


def _ratio(value: float | None) -> str:
    """A ratio for the table ("-" where its baseline setting did not run)."""
    return "-" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    main()
