"""Prefill tokens/s and decode step time per dtype and quantization, in the same run.

    python bench/engine_steps.py                    # the default model, one thread
    python bench/engine_steps.py --model smollm2-135m-instruct --rounds 5 --clock cpu
    python bench/engine_steps.py --settings bfloat16+auto:bf16-head,bfloat16+auto --rounds 20
    python bench/engine_steps.py --settings float32+auto:layers,float32+auto --rounds 20
    python bench/engine_steps.py --settings float32+auto,float32+auto:team2 --batch 8

One runner per setting (float32, bfloat16, bfloat16 + int8, bfloat16 + int4 re-quantized from
the floats, and bfloat16 + ``auto``: a GGUF's Q4_0 / Q4_1 / Q4_K weights as the file stores
them, on torch's int4 kernel (``auto:torch``) and on pdserve's, `pdserve.engine.int4_kernel`,
with a Q8_0 LM head on pdserve's int8 kernel, or kept bf16 as before it (``auto:bf16-head``);
float32 + ``auto`` on a CPU without native bf16 decodes in one compiled call per step,
`pdserve.engine.fused_decode`, or layer by layer as before it with ``auto:layers``),
each with the same random prompts prefilled into its paged KV cache. Every round measures,
setting after setting (so machine noise hits all alike): a prefill of one prompt, then decode
steps of 1 and of all streams (one new token each, the model's forward and logits; no
sampling). Medians per setting, and ratios against float32 and bfloat16 computed from the
same rounds. The CPU and its flags are printed and recorded.

A one-row step streams every projection's weight once (`streamed_bytes`: the layers' and the
LM head's, not the embedding, of which it reads one row). Its floor is those bytes at the
machine's read bandwidth, measured here on one thread and the same clock (`read_bandwidth`: the
median time of a sum over a buffer far larger than the caches); the table gives each one-row
step against it, and against a floor that also counts the K and V the step's attention reads
(every layer's, over the mean context of the one-row steps measured: the prompt and the steps
before, growing with `--rounds` and `--steps`).

A round's one-row steps are timed after `--warmup-steps` (2) untimed ones: the first one-row
steps after a prefill in the same process ran 20-30% slower than the rest (medians by position
5.0, 4.5-4.8, 3.9-4.3, then 3.8 ms on a 2-core EPYC: the prefill had displaced the step's own
working set; a handful of page faults, not the cause), and a decode instance never runs a
prefill between its steps. `--warmup-steps 0` times them as before.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
from common import cpu_description, prefilled_streams, write_results

from pdserve.engine import cpu_kernels, int4_kernel, int8_kernel
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.fused_decode import FusedDecode
from pdserve.engine.linear import Linear
from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model
from pdserve.engine.quant import Int4Linear, Int8GroupLinear, Int8Linear, weight_bytes

SETTINGS = (
    ("float32", "none"),
    ("bfloat16", "none"),
    ("bfloat16", "int8"),
    ("bfloat16", "int4"),
    ("bfloat16", "auto:torch"),
    ("bfloat16", "auto:bf16-head"),
    ("bfloat16", "auto"),
)
TORCH_KERNEL = ":torch"
"""A setting's suffix: its int4 projections on torch's kernel instead of pdserve's."""
BF16_HEAD = ":bf16-head"
"""A setting's suffix: a Q8_0 LM head dequantized to bf16 (as before pdserve's int8 kernel)."""
LAYER_BY_LAYER = ":layers"
"""A setting's suffix: float32 decode steps layer by layer, not in one compiled call
(`pdserve.engine.fused_decode`, as before it)."""
TEAM = ":team"
"""A setting's suffix with a count (``auto:team2``): the float32 GEMMs' output rows shared by
that many threads (`pdserve.engine.cpu_kernels.set_team_threads`); its floor is the read
bandwidth of as many threads."""
BLOCK_SIZE = 16
BANDWIDTH_BUFFER_BYTES = 1 << 30


def team_size(quantization: str) -> int:
    """The kernel threads a setting runs (1 without the `TEAM` suffix)."""
    _, found, count = quantization.partition(TEAM)
    return int(count) if found else 1


def streamed_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a one-row decode step reads: every projection's (packed) weight, scales
    and bias, and the norms; not the embedding (one row of it)."""
    total = 0
    for module in model.modules():
        tensors: list[torch.Tensor | None] = []
        if isinstance(module, Linear):
            weight = module.packed_weight if module.packed_weight is not None else module.weight_t
            tensors = [weight, module.bias]
        elif isinstance(module, Int8Linear):
            tensors = [module.weight, module.scales, module.bias]
        elif isinstance(module, Int4Linear):
            tensors = [module.packed, module.scales, module.mins, module.scale_zeros, module.bias]
        elif isinstance(module, Int8GroupLinear):
            tensors = [module.values, module.scales]
        elif type(module).__name__.endswith("RMSNorm"):
            tensors = [module.weight]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def kv_bytes_per_token(runner: Any) -> int:
    """Bytes of K and V one token holds over every layer (what attention reads per key)."""
    layout = runner.kv_cache.layout
    return layout.total_block_nbytes // layout.block_size


def read_bandwidth(clock: str, rounds: int = 7, threads: int = 1) -> float:
    """Bytes per second `threads` threads read: a sum over a float32 buffer far larger than the
    caches.

    NOTE: on `clock` like the steps: on a busy machine the wall clock also counts the time
    other jobs held the core (7.5 GB/s wall against 32 GB/s of CPU time, load average 10).
    float32, not bf16: a bf16 sum runs at the memory's speed only where the CPU has bf16
    instructions (9.8 GB/s against 2x that in float32 on an AVX2-only EPYC).
    """
    buffer = torch.ones(BANDWIDTH_BUFFER_BYTES // 4, dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer.sum()
        times = [timed(buffer.sum, clock) for _ in range(rounds)]
    finally:
        torch.set_num_threads(before)
    return BANDWIDTH_BUFFER_BYTES / statistics.median(times)


def clock_now(clock: str) -> float:
    return time.process_time() if clock == "cpu" else time.perf_counter()


def timed(fn: Callable[[], Any], clock: str) -> float:
    start = clock_now(clock)
    fn()
    return clock_now(clock) - start


class Streams:
    """One setting's runner and its prefilled streams, advanced one token per decode step."""

    def __init__(self, runner: Any, sequences: list[list[int]], tables: list[list[int]]) -> None:
        self.runner = runner
        self.sequences = sequences
        self.tables = tables
        self.lengths = [len(s) for s in sequences]
        self.one_row_contexts: list[int] = []  # each one-row step's keys (its own included)

    def prefill(self) -> None:
        # NOTE: re-runs stream 0's prompt over its own blocks: the same KV is written again.
        self.runner.execute([ScheduledChunk(self.sequences[0], 0, self.tables[0])])

    def decode_step(self, num_rows: int) -> None:
        if num_rows == 1:
            self.one_row_contexts.append(self.lengths[0] + 1)
        chunks = []
        for row in range(num_rows):
            position = self.lengths[row]
            chunks.append(ScheduledChunk([self.sequences[row][-1]], position, self.tables[row]))
            self.lengths[row] += 1
        self.runner.execute(chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="any --model value")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per batch and round")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="untimed one-row steps before a round's timed ones (after the round's prefill)",
    )
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32, help="streams of the larger decode")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument(
        "--settings",
        default=",".join(f"{d}+{q}" for d, q in SETTINGS),
        help="comma-separated dtype+quantization to run (an A/B of two: more rounds for the "
        "time; the ratios to float32 and bfloat16 need those settings)",
    )
    args = parser.parse_args()
    settings = [tuple(item.split("+", 1)) for item in args.settings.split(",")]
    torch.set_num_threads(1)
    model_dir = resolve_model(args.model).path
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']}, torch capability {cpu['torch_cpu_capability']}")
    print(f"flags: {' '.join(cpu['flags'])}")
    num_steps = args.rounds * (args.steps * 2 + args.warmup_steps)
    streams: dict[tuple[str, str], Streams] = {}
    sizes: dict[tuple[str, str], float] = {}
    streamed: dict[tuple[str, str], float] = {}
    for dtype, quantization in settings:
        kernel_choice: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if quantization.endswith(TORCH_KERNEL):
            kernel_choice = mock.patch.object(int4_kernel, "takes", return_value=False)
        elif quantization.endswith(BF16_HEAD):
            kernel_choice = mock.patch.object(int8_kernel, "why_not", return_value="bench")
        elif quantization.endswith(LAYER_BY_LAYER):
            kernel_choice = mock.patch.object(FusedDecode, "why_not", return_value="bench")
        if TEAM in quantization and args.clock == "cpu":
            parser.error("a kernel team's threads are not one process clock: use --clock wall")
        with kernel_choice:
            runner, sequences, tables = prefilled_streams(
                model_dir,
                args.batch,
                args.prompt_len,
                num_steps,
                BLOCK_SIZE,
                dtype,
                quantization.partition(":")[0],
            )
        streams[dtype, quantization] = Streams(runner, sequences, tables)
        sizes[dtype, quantization] = weight_bytes(runner.model) / 1e6
        streamed[dtype, quantization] = streamed_bytes(runner.model) / 1e6
    bandwidths = {
        threads: read_bandwidth(args.clock, threads=threads)
        for threads in sorted({team_size(q) for _, q in settings})
    }
    for threads, bandwidth in bandwidths.items():
        print(
            f"read bandwidth, {threads} thread(s), {args.clock} clock: {bandwidth / 1e9:.1f} GB/s"
        )
    samples: dict[str, dict[tuple[str, str], list[float]]] = {
        "prefill_s": {key: [] for key in streams},
        "decode_1_s": {key: [] for key in streams},
        f"decode_{args.batch}_s": {key: [] for key in streams},
    }
    for _ in range(args.rounds):
        for key, each in streams.items():
            cpu_kernels.set_team_threads(team_size(key[1]))
            samples["prefill_s"][key].append(timed(each.prefill, args.clock))
            for _ in range(args.warmup_steps):
                each.decode_step(1)
                each.one_row_contexts.pop()  # NOTE: the KV floor counts the timed steps'
            for num_rows, metric in ((1, "decode_1_s"), (args.batch, f"decode_{args.batch}_s")):
                step = functools.partial(each.decode_step, num_rows)
                samples[metric][key].extend(timed(step, args.clock) for _ in range(args.steps))
    medians = {
        metric: {key: statistics.median(values) for key, values in by_key.items()}
        for metric, by_key in samples.items()
    }
    print(
        f"\n{args.model}, threads=1, prompt {args.prompt_len} tokens, {args.rounds} rounds, "
        f"{args.clock} clock\n"
    )
    print(
        f"| setting | weights MB | streamed per step MB | prefill tok/s | "
        f"decode step, 1 row (ms) | floor, 1 row (ms) | 1 row vs floor | "
        f"KV read, 1 row (MB) | 1 row vs floor with KV | "
        f"decode step, {args.batch} rows (ms) | prefill vs fp32 | decode 1 vs fp32 | "
        f"decode 1 vs bf16 | decode {args.batch} vs bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    fp32, bf16 = ("float32", "none"), ("bfloat16", "none")
    big = f"decode_{args.batch}_s"

    def speedup(metric: str, base: tuple[str, str], key: tuple[str, str]) -> float | None:
        """> 1: faster than `base` (None where `base` did not run)."""
        if base not in medians[metric]:
            return None
        return medians[metric][base] / medians[metric][key]

    def shown(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for key in streams:
        prefill = medians["prefill_s"][key]
        decode_1 = medians["decode_1_s"][key]
        floor_s = streamed[key] * 1e6 / bandwidths[team_size(key[1])]
        each = streams[key]
        kv_mb = kv_bytes_per_token(each.runner) * statistics.mean(each.one_row_contexts) / 1e6
        floor_kv_s = (streamed[key] + kv_mb) * 1e6 / bandwidths[team_size(key[1])]
        row = {
            "dtype": key[0],
            "quantization": key[1],
            "weight_mb": sizes[key],
            "streamed_mb": streamed[key],
            "prefill_tokens_per_s": args.prompt_len / prefill,
            "decode_1_ms": decode_1 * 1e3,
            "floor_1_ms": floor_s * 1e3,
            "decode_1_vs_floor": decode_1 / floor_s,
            "kv_read_1_mb": kv_mb,
            "floor_1_with_kv_ms": floor_kv_s * 1e3,
            "decode_1_vs_floor_with_kv": decode_1 / floor_kv_s,
            f"decode_{args.batch}_ms": medians[big][key] * 1e3,
            "prefill_speedup_vs_float32": speedup("prefill_s", fp32, key),
            "decode_1_speedup_vs_float32": speedup("decode_1_s", fp32, key),
            "decode_1_speedup_vs_bfloat16": speedup("decode_1_s", bf16, key),
            f"decode_{args.batch}_speedup_vs_bfloat16": speedup(big, bf16, key),
        }
        rows.append(row)
        name = key[0] if key[1] == "none" else f"{key[0]} + {key[1]}"
        print(
            f"| {name} | {row['weight_mb']:.0f} | {row['streamed_mb']:.0f} | "
            f"{row['prefill_tokens_per_s']:.0f} | {row['decode_1_ms']:.2f} | "
            f"{row['floor_1_ms']:.2f} | {row['decode_1_vs_floor']:.2f}x | "
            f"{row['kv_read_1_mb']:.1f} | {row['decode_1_vs_floor_with_kv']:.2f}x | "
            f"{row[f'decode_{args.batch}_ms']:.2f} | {shown(row['prefill_speedup_vs_float32'])} | "
            f"{shown(row['decode_1_speedup_vs_float32'])} | "
            f"{shown(row['decode_1_speedup_vs_bfloat16'])} | "
            f"{shown(row[f'decode_{args.batch}_speedup_vs_bfloat16'])} |"
        )
    path = write_results(
        "engine_steps",
        {
            "config": {
                **vars(args),
                "threads": 1,
                "read_bandwidth_bytes_per_s": {str(t): b for t, b in bandwidths.items()},
                **cpu,
            },
            "rows": rows,
            "samples": {m: {f"{k[0]}+{k[1]}": v for k, v in s.items()} for m, s in samples.items()},
        },
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
