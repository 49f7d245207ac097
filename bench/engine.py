"""LLMEngine vs transformers `generate` on the same machine, in the same run.

    python bench/engine.py                          # full run, wall clock, torch's threads
    python bench/engine.py --threads 1 --clock cpu  # ratios of process CPU time: robust when
                                                    # other work shares the machine
    python bench/engine.py --quick                  # smaller smoke run
    python bench/engine.py --model smollm2-135m-instruct --threads 1 --clock cpu
                                                    # a real model (any --model value)
    python bench/engine.py --model smollm2-135m-instruct --device cuda --dtype bfloat16
                                                    # both on a GPU (wall clock)
    python bench/engine.py --model smollm2-135m-instruct --threads 1 --clock cpu \
        --quantization int8                         # the engine's projections in int8

``--dtype auto`` (the default) is what the engine serves with: bfloat16 on a CPU with native
bf16, else float32; transformers runs the same dtype (unquantized). The CPU model and its flags
are printed and recorded. Per-dtype step times: bench/engine_steps.py.

Workload: a random Llama (8 layers, hidden 512, 8 heads / 4 KV heads, vocab 32000), or the
model given with --model (transformers loads the same prepared checkpoint), and
32 requests with prompt lengths uniform in [16, 192] and output lengths uniform in [16, 160],
all greedy with EOS ignored so every request produces exactly its length. Baselines:

* HF sequential: `generate` one request at a time.
* HF padded batches: static batches (left padding); a batch runs until its longest request is
  done, so throughput counts only the tokens each request asked for.
* LLMEngine: all requests added at once (continuous batching, paged KV cache).

Single-request latency compares `generate` and `LLMEngine.generate` on one request at a time
(median over several). The attention the engine runs (``sdpa``, ``flash-attn-4``, ...) is
printed and recorded. Results print as a table and are written to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from common import build_random_llama, cpu_description, write_results

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from pdserve.engine.model_store import resolve_model
from pdserve.engine.precision import QUANTIZATIONS, choose_dtype


def make_workload(
    num: int, seed: int, vocab_size: int, max_output_len: int = 160
) -> list[tuple[list[int], int]]:
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(16, 193, (num,), generator=generator).tolist()
    output_lens = torch.randint(16, max_output_len + 1, (num,), generator=generator).tolist()
    return [
        (torch.randint(3, vocab_size, (p,), generator=generator).tolist(), n)
        for p, n in zip(prompt_lens, output_lens, strict=True)
    ]


def hf_generate(model: Any, batch: list[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy `generate` of a left-padded static batch; each row is cut to its own length.

    The inputs go to the model's device; on CUDA the call returns once the tokens are back.
    """
    max_prompt = max(len(p) for p, _ in batch)
    max_new = max(n for _, n in batch)
    input_ids = torch.zeros(len(batch), max_prompt, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, _) in enumerate(batch):
        input_ids[row, max_prompt - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, max_prompt - len(prompt) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    out = out.cpu()
    return [out[row, max_prompt : max_prompt + n].tolist() for row, (_, n) in enumerate(batch)]


def engine_generate(engine: LLMEngine, batch: list[tuple[list[int], int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in batch]
    return engine.generate([p for p, _ in batch], params)


class Timing(NamedTuple):
    """Wall-clock and process CPU seconds of one run."""

    wall: float
    cpu: float

    def get(self, clock: str) -> float:
        return self.cpu if clock == "cpu" else self.wall


def timed(fn: Any, *args: Any) -> tuple[Timing, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    return Timing(time.perf_counter() - wall, time.process_time() - cpu), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="8 requests of at most 48 tokens, 4 layers, 1 round"
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--latency-runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="engine vs HF padded repetitions")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="what the ratios compare; cpu (process time, with --threads 1) resists other load",
    )
    parser.add_argument("--model-dir", type=Path, help="reuse/keep the random checkpoint here")
    parser.add_argument(
        "--model", help="serve this model instead of a random one (see `pdserve pull --help`)"
    )
    parser.add_argument(
        "--linear-backend",
        choices=("auto", "onednn", "torch"),
        default="auto",
        help="the engine's projections: oneDNN-packed (auto on CPU float32) or torch's GEMM",
    )
    parser.add_argument(
        "--skip-sequential", action="store_true", help="skip the slow HF one-at-a-time baseline"
    )
    parser.add_argument("--device", default="cpu", help="torch device of both, e.g. cuda")
    parser.add_argument(
        "--dtype", default="auto", help="weights (and the engine's KV) of both, e.g. bfloat16"
    )
    parser.add_argument(
        "--quantization", choices=QUANTIZATIONS, default="none", help="the engine's weights"
    )
    parser.add_argument(
        "--attention-backend",
        choices=("auto", "sdpa", "flash"),
        default="auto",
        help="the engine's attention (auto: flash-attn where usable, else SDPA)",
    )
    args = parser.parse_args()
    if args.device != "cpu" and args.clock == "cpu":
        parser.error("--clock cpu measures the host only: use the wall clock on a GPU")
    torch.set_num_threads(args.threads)
    num_layers = 4 if args.quick else 8
    num_requests = 8 if args.quick else args.num_requests
    rounds = 1 if args.quick else args.rounds
    vocab_size, hidden_size = 32000, 512
    clock = args.clock
    dtype = choose_dtype(args.dtype, torch.device(args.device)).dtype
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']}, torch capability {cpu['torch_cpu_capability']}")
    print(f"flags: {' '.join(cpu['flags'])}")

    if args.model:
        model_dir = resolve_model(args.model).path
        hf_config = json.loads((model_dir / "config.json").read_text())
        num_layers, vocab_size = hf_config["num_hidden_layers"], hf_config["vocab_size"]
        hidden_size = hf_config["hidden_size"]
    else:
        model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="pdserve-bench-engine-"))
        build_random_llama(
            model_dir, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size
        )
    from transformers import AutoModelForCausalLM

    hf = (
        AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
        )
        .to(args.device)
        .eval()
    )
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            quantization=args.quantization,
            device=args.device,
            attention_backend=args.attention_backend,
            seed=0,
            linear_backend=args.linear_backend,
            cache=CacheConfig(block_size=16, num_blocks=2048),
            scheduler=SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=2048),
        )
    )
    max_output_len = 48 if args.quick else 160
    workload = make_workload(num_requests, 0, vocab_size, max_output_len)
    num_tokens = sum(n for _, n in workload)
    warmup = make_workload(2, seed=1, vocab_size=vocab_size)
    hf_generate(hf, warmup[:1])
    hf_generate(hf, warmup)
    engine_generate(engine, warmup)

    rows: list[dict[str, Any]] = []

    def record(name: str, timing: Timing, tokens: list[list[int]]) -> float:
        assert sum(len(t) for t in tokens) == num_tokens
        rows.append({"run": name, "wall_s": timing.wall, "cpu_s": timing.cpu})
        print(
            f"  {name:<34} wall {timing.wall:7.2f} s  cpu {timing.cpu:7.2f} s  "
            f"{num_tokens / timing.get(clock):8.1f} tok/s ({clock})",
            flush=True,
        )
        return num_tokens / timing.get(clock)

    def hf_padded(batch_size: int) -> tuple[Timing, list[list[int]]]:
        def run() -> list[list[int]]:
            padded: list[list[int]] = []
            for first in range(0, num_requests, batch_size):
                padded.extend(hf_generate(hf, workload[first : first + batch_size]))
            return padded

        return timed(run)

    attention = engine.runner.attention_backend
    print(
        f"{num_requests} requests, {num_tokens} output tokens, threads={args.threads}, "
        f"device={args.device}, dtype={dtype} ({args.dtype}), quantization={args.quantization}, "
        f"attention={attention}"
    )
    # NOTE: the machine is shared and noisy: alternate the engine and its main baseline and
    # compare them round by round.
    same_batch_ratios, engine_tps = [], []
    for round_index in range(rounds):
        timing, ours = timed(engine_generate, engine, workload)
        engine_tps.append(
            record(f"LLMEngine, {num_requests} concurrent [{round_index}]", timing, ours)
        )
        timing, padded = hf_padded(num_requests)
        hf_tps = record(f"HF padded, batch {num_requests} [{round_index}]", timing, padded)
        same_batch_ratios.append(engine_tps[-1] / hf_tps)
    small_batch = min(8, num_requests // 2)
    hf_small_tps = record(f"HF padded, batch {small_batch}", *hf_padded(small_batch))
    if args.skip_sequential:
        # NOTE: the padded batch of 1 per request is skipped; compare with the padded outputs.
        sequential = padded
        hf_sequential_tps = float("nan")
    else:
        timing, sequential = timed(lambda: [hf_generate(hf, [item])[0] for item in workload])
        hf_sequential_tps = record("HF sequential", timing, sequential)
    matches = sum(a == b for a, b in zip(ours, sequential, strict=True))

    latency_items = make_workload(args.latency_runs, seed=2, vocab_size=vocab_size)
    latency_items = [(prompt[:128], 64) for prompt, _ in latency_items]
    engine_latency, hf_latency = [], []
    for item in latency_items:
        # NOTE: alternate the two so that machine noise hits both alike.
        engine_latency.append(timed(engine_generate, engine, [item])[0].get(clock))
        hf_latency.append(timed(hf_generate, hf, [item])[0].get(clock))

    median_engine_tps = statistics.median(engine_tps)
    summary = {
        "throughput_vs_hf_padded_same_batch": statistics.median(same_batch_ratios),
        f"throughput_vs_hf_padded_batch_{small_batch}": median_engine_tps / hf_small_tps,
        "throughput_vs_hf_sequential": median_engine_tps / hf_sequential_tps,
        "single_request_latency_engine_s": statistics.median(engine_latency),
        "single_request_latency_hf_s": statistics.median(hf_latency),
        "single_request_latency_ratio": statistics.median(
            e / h for e, h in zip(engine_latency, hf_latency, strict=True)
        ),
        "greedy_outputs_identical_to_hf": f"{matches}/{num_requests}",
        "attention_backend": attention,
    }
    print(f"\n| metric ({clock} clock) | value |\n|---|---|")
    for key, value in summary.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"| {key} | {shown} |")
    path = write_results(
        "engine",
        {
            "config": {
                "model": args.model or "random llama",
                "num_layers": num_layers,
                "hidden_size": hidden_size,
                "vocab_size": vocab_size,
                "num_requests": num_requests,
                "num_output_tokens": num_tokens,
                "threads": args.threads,
                "linear_backend": args.linear_backend,
                "device": args.device,
                "dtype": dtype,
                "requested_dtype": args.dtype,
                "quantization": args.quantization,
                **cpu,
                "attention_backend": attention,
                "clock": clock,
                "latency_request": "prompt 128, output 64",
            },
            "runs": rows,
            "same_batch_ratios": same_batch_ratios,
            "latency_engine_s": engine_latency,
            "latency_hf_s": hf_latency,
            "summary": summary,
        },
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
