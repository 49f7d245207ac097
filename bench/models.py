"""Model families: a mixture of experts against a dense model of the same active size, and
the load of a sharded checkpoint (time and peak memory against the size of its weights).

    python bench/models.py            # both parts (CPU, one thread)
    python bench/models.py --quick    # smaller models, fewer steps

**MoE vs dense.** Two random checkpoints with the same attention and the same *active*
feed-forward per token: a dense Llama with intermediate size ``I`` and a Mixtral whose 8
experts have ``I / 2`` each, two routed per token (4x the feed-forward weights in all). Both
decode ``--steps`` steps at batch 1 and 8 and prefill one 256-token chunk on one thread; the
ratio MoE / dense of the median step time is reported. Steps are timed in process CPU time
(one thread), so other work on the machine does not skew the ratio.

**Sharded load.** A random Llama saved in shards of ``--shard-mb`` MiB with its index is
loaded by the engine in a fresh process; the process's peak resident memory (``VmHWM``) above
what it held before the load (torch imported) is divided by the size of the weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import write_results

BLOCK_SIZE = 16


def build(path: Path, kind: str, hidden: int, layers: int, intermediate: int) -> Path:
    """A random dense Llama or Mixtral (8 experts of ``intermediate // 2``, top 2)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    common: dict[str, Any] = {
        "vocab_size": 32000,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
    }
    if kind == "moe":
        config = AutoConfig.for_model(
            "mixtral",
            intermediate_size=intermediate // 2,
            num_local_experts=8,
            num_experts_per_tok=2,
            **common,
        )
    else:
        config = AutoConfig.for_model("llama", intermediate_size=intermediate, **common)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    return path


def step_times(model_dir: Path, batch: int, steps: int, prompt_len: int = 64) -> dict[str, float]:
    """Median decode step (ms) at `batch` and the time of one 256-token prefill chunk (ms)."""
    import torch

    from pdserve.engine.batch import ScheduledChunk
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.runner import ModelRunner

    torch.set_num_threads(1)
    per_seq = (prompt_len + steps + 256) // BLOCK_SIZE + 2
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        num_threads=1,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=(batch + 1) * per_seq),
    )
    runner = ModelRunner.load(config)
    generator = torch.Generator().manual_seed(0)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch + 1)]
    seqs = [torch.randint(3, 32000, (prompt_len,), generator=generator).tolist() for _ in tables]
    for seq, table in zip(seqs[:batch], tables, strict=False):
        runner.execute([ScheduledChunk(seq, 0, table)])
    times = []
    for step in range(steps):
        chunks = [
            ScheduledChunk([seq[-1]], prompt_len - 1 + step, table)
            for seq, table in zip(seqs[:batch], tables, strict=False)
        ]
        # NOTE: the last prompt token again at each next position: the work is what counts.
        start = time.process_time()
        runner.execute(chunks)
        times.append(time.process_time() - start)
    prompt = torch.randint(3, 32000, (256,), generator=generator).tolist()
    prefill = []
    for _ in range(3):
        start = time.process_time()
        runner.execute([ScheduledChunk(prompt, 0, tables[-1])])
        prefill.append(time.process_time() - start)
    return {
        "decode_ms": statistics.median(times) * 1e3,
        "prefill_256_ms": statistics.median(prefill) * 1e3,
    }


_LOAD_PROBE = """
import json, sys, time
import torch
from pdserve.engine.loader import load_model

def status_kib(key):
    # NOTE: VmHWM, not ru_maxrss: the latter carries the parent's peak across fork and exec.
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields[key].split()[0])

before = status_kib("VmRSS")
start = time.perf_counter()
model = load_model(sys.argv[1], torch.float32, linear_backend="torch")
elapsed = time.perf_counter() - start
peak, after = status_kib("VmHWM"), status_kib("VmRSS")
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"load_s": elapsed, "peak_above_start_mib": (peak - before) / 1024,
                  "held_after_mib": (after - before) / 1024, "weights_mib": weights / 2**20}))
"""


def sharded_load(path: Path, shard_mb: int, hidden: int, layers: int) -> dict[str, Any]:
    """Saves a random Llama in shards and measures the engine's load in a fresh process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, safe_serialization=True, max_shard_size=f"{shard_mb}MB")
    del model
    num_shards = len(list(path.glob("*.safetensors")))
    probe = subprocess.run(
        [sys.executable, "-c", _LOAD_PROBE, str(path)], capture_output=True, text=True, check=True
    )
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    result["num_shards"] = num_shards
    result["peak_over_weights"] = result["peak_above_start_mib"] / result["weights_mib"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--shard-mb", type=int, default=100)
    args = parser.parse_args()
    hidden, layers, steps = (256, 4, 8) if args.quick else (512, 8, args.steps)
    intermediate = hidden * 11 // 4
    results: dict[str, Any] = {"hidden_size": hidden, "num_layers": layers, "steps": steps}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {kind: build(Path(tmp) / kind, kind, hidden, layers, intermediate) for kind in
                ("dense", "moe")}  # fmt: skip
        for batch in (1, 8):
            for kind, model_dir in dirs.items():
                results[f"{kind}_batch{batch}"] = step_times(model_dir, batch, steps)
        load_hidden, load_layers = (512, 4) if args.quick else (1024, 16)
        results["sharded_load"] = sharded_load(
            Path(tmp) / "sharded", args.shard_mb, load_hidden, load_layers
        )
    print(f"MoE (8 experts of I/2, top 2) vs dense (I={intermediate}), hidden {hidden}, "
          f"{layers} layers, CPU, 1 thread")  # fmt: skip
    print(f"{'measure':<26}{'dense ms':>10}{'moe ms':>10}{'moe/dense':>11}")
    for batch in (1, 8):
        dense, moe = results[f"dense_batch{batch}"], results[f"moe_batch{batch}"]
        for key in ("decode_ms", "prefill_256_ms") if batch == 1 else ("decode_ms",):
            label = f"{key.removesuffix('_ms')} batch {batch}" if key == "decode_ms" else key
            print(f"{label:<26}{dense[key]:>10.2f}{moe[key]:>10.2f}{moe[key] / dense[key]:>10.2f}x")
    load = results["sharded_load"]
    print(
        f"sharded load: {load['num_shards']} shards, {load['weights_mib']:.0f} MiB of weights, "
        f"{load['load_s']:.2f} s, peak {load['peak_above_start_mib']:.0f} MiB above start "
        f"= {load['peak_over_weights']:.2f}x the weights"
    )
    print(f"results: {write_results('models', results)}")


if __name__ == "__main__":
    main()
