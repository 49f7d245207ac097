"""What reading a checkpoint's packed weights costs at load (`pdserve.engine.packed_weights`):
seconds per weight of the released models' shapes, made in bfloat16 from random packed bytes.

* MXFP4: one gpt-oss-20b expert stack of gate and up (``[32, 5760, 2880]``) and of down
  (``[32, 2880, 2880]``), as the loader makes them (one expert at a time).
* Block FP8: a DeepSeek-V3 expert's gate (``[2048, 7168]``) and its attention output projection
  (``[7168, 16384]``), 128 x 128 blocks.

    .venv/bin/python bench/packed_weights.py [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from common import cpu_description, write_results

from pdserve.engine.packed_weights import dequantize_fp8, dequantize_mxfp4

MXFP4_SHAPES = {"gpt-oss-20b gate_up (32 experts)": (32, 5760, 2880),
                "gpt-oss-20b down (32 experts)": (32, 2880, 2880)}  # fmt: skip
FP8_SHAPES = {"DeepSeek-V3 expert gate": (2048, 7168), "DeepSeek-V3 o_proj": (7168, 16384)}


def _timed(work: Callable[[], torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure(repeats: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    rows: dict[str, Any] = {}
    for name, (experts, out, cols) in MXFP4_SHAPES.items():
        blocks = torch.randint(0, 256, (experts, out, cols // 32, 16), dtype=torch.uint8)
        scales = torch.randint(118, 130, (experts, out, cols // 32), dtype=torch.uint8)
        seconds = _timed(partial(dequantize_mxfp4, blocks, scales, torch.bfloat16), repeats)
        rows[name] = {
            "seconds": round(seconds, 3),
            "seconds_per_expert": round(seconds / experts, 4),
            "packed_mb": round((blocks.numel() + scales.numel()) / 1e6, 1),
        }
    for name, (out, cols) in FP8_SHAPES.items():
        weight = torch.randn(out, cols, generator=generator).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-out // 128), -(-cols // 128), generator=generator)
        work = partial(dequantize_fp8, weight, scale, (128, 128), torch.bfloat16)
        seconds = _timed(work, repeats)
        rows[name] = {"seconds": round(seconds, 3), "packed_mb": round(weight.numel() / 1e6, 1)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    rows = measure(args.repeats)
    record = {"cpu": cpu_description(), "torch_threads": torch.get_num_threads(), "rows": rows}
    path = write_results("packed_weights", record)
    if args.json:
        print(json.dumps(record, indent=2))
        return
    print("cpu:", record["cpu"])
    for name, row in rows.items():
        print(f"{name:<40}" + "  ".join(f"{key} {value}" for key, value in row.items()))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
