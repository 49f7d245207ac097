"""Whole-process memory (RSS and PSS) of one engine per dtype and quantization.

    python bench/engine_memory.py                   # the default model

Each setting runs in a fresh process: it loads a `ModelRunner` with a small fixed KV cache
(64 blocks of 16), prefills one 256-token prompt and runs 8 one-row decode steps, then reads
its own ``/proc/self/smaps_rollup``. The difference between settings is the weights (and what
loading them left behind); torch's own libraries are in every row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from common import write_results

from pdserve.engine.model_store import DEFAULT_MODEL

SETTINGS = (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "auto"))
CHILD = """
import json, sys, torch
from pdserve.engine import CacheConfig, EngineConfig
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.model_store import resolve_model
from pdserve.engine.quant import weight_bytes
from pdserve.engine.runner import ModelRunner

model, dtype, quantization = sys.argv[1:4]
torch.set_num_threads(1)
config = EngineConfig(
    model=str(resolve_model(model).path), dtype=dtype, quantization=quantization,
    cache=CacheConfig(block_size=16, num_blocks=64),
)
runner = ModelRunner.load(config)
blocks = list(range(17))
prompt = list(range(100, 356))
runner.execute([ScheduledChunk(prompt, 0, blocks)])
for step in range(8):
    runner.execute([ScheduledChunk([prompt[-1]], len(prompt) + step, blocks)])
fields = {}
with open("/proc/self/smaps_rollup") as rollup:
    for line in rollup:
        key, _, value = line.partition(":")
        if key in ("Rss", "Pss"):
            fields[key.lower() + "_mb"] = int(value.split()[0]) / 1024
fields["weight_mb"] = weight_bytes(runner.model) / 1e6
print(json.dumps(fields))
"""


def measure(model: str, dtype: str, quantization: str) -> dict[str, Any]:
    command = [sys.executable, "-c", CHILD, model, dtype, quantization]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    row: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return {"dtype": dtype, "quantization": quantization, **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    args = parser.parse_args()
    rows = [measure(args.model, dtype, quantization) for dtype, quantization in SETTINGS]
    print(f"{args.model}, one process per setting\n")
    print("| dtype | quantization | weights MB | RSS MB | PSS MB |")
    print("|---|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['dtype']} | {row['quantization']} | {row['weight_mb']:.0f} | "
            f"{row['rss_mb']:.0f} | {row['pss_mb']:.0f} |"
        )
    path = write_results("engine_memory", {"model": args.model, "rows": rows})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
