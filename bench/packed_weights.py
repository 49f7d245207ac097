"""What reading a checkpoint's packed weights costs at load (`pdserve.engine.packed_weights`):
seconds per weight of the released models' shapes, made in bfloat16 from random packed bytes.

* MXFP4: one gpt-oss-20b expert stack of gate and up (``[32, 5760, 2880]``) and of down
  (``[32, 2880, 2880]``), as the loader makes them (one expert at a time).
  Each also as its codes packed for the int4 kernel (`KeptExperts.load_mxfp4`, the form the
  loader keeps with bfloat16 activations) and as int8 groups
  (`pdserve.engine.packed_weights.mxfp4_as_int8`, the form it keeps in float32), and the
  megabytes of each form.
* Block FP8: a DeepSeek-V3 expert's gate (``[2048, 7168]``) and its attention output projection
  (``[7168, 16384]``), 128 x 128 blocks.
* The experts of one gpt-oss-20b MoE layer at work (``--experts`` of its 32, hidden and
  intermediate 2,880, top 4, clamped SwiGLU), bfloat16 activations on one torch thread: the
  milliseconds of a call for 1, 4 and 32 tokens (each token's 4 experts drawn at random) with
  the weights in bfloat16 (`pdserve.engine.moe.Experts`), kept as MXFP4 codes and as int8
  groups (the same MXFP4 values) and as int4 groups (a Q4 GGUF's;
  `pdserve.engine.moe.KeptExperts`), and their ratios, with the bytes of the experts a
  one-token call reads in each form.

    .venv/bin/python bench/packed_weights.py [--repeats 3] [--experts 8] [--json]
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

import pdserve.engine.int8_kernel as int8_kernel
from pdserve.engine.arch_config import MoeConfig
from pdserve.engine.moe import Experts, KeptExperts
from pdserve.engine.packed_weights import (
    dequantize_fp8,
    dequantize_mxfp4,
    mxfp4_as_int8,
    mxfp4_codes,
)

MXFP4_SHAPES = {"gpt-oss-20b gate_up (32 experts)": (32, 5760, 2880),
                "gpt-oss-20b down (32 experts)": (32, 2880, 2880)}  # fmt: skip
GPT_OSS_HIDDEN = GPT_OSS_INTERMEDIATE = 2880
GPT_OSS_TOP_K = 4
STEP_TOKENS = (1, 4, 32)
PART_SHAPES = {"gate_up_proj": (2 * GPT_OSS_INTERMEDIATE, GPT_OSS_HIDDEN),
               "down_proj": (GPT_OSS_HIDDEN, GPT_OSS_INTERMEDIATE)}  # fmt: skip
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
        int8_seconds = _timed(partial(mxfp4_as_int8, blocks, scales), repeats)
        codes_seconds = _timed(partial(_load_codes, blocks, scales, experts, out), repeats)
        num_values = experts * out * cols
        rows[name] = {
            "seconds": round(seconds, 3),
            "seconds_per_expert": round(seconds / experts, 4),
            "int8_seconds": round(int8_seconds, 3),
            "mxfp4_seconds": round(codes_seconds, 3),
            "packed_mb": round((blocks.numel() + scales.numel()) / 1e6, 1),
            "bfloat16_mb": round(2 * num_values / 1e6, 1),
            # NOTE: a float16 scale per 32 values (`KeptExperts.load_int8`)
            "int8_mb": round((num_values + 2 * num_values // 32) / 1e6, 1),
            # NOTE: two codes a byte, a float16 scale per 32 (`KeptExperts.load_mxfp4`)
            "mxfp4_mb": round((num_values // 2 + 2 * num_values // 32) / 1e6, 1),
        }
    for name, (out, cols) in FP8_SHAPES.items():
        weight = torch.randn(out, cols, generator=generator).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-out // 128), -(-cols // 128), generator=generator)
        work = partial(dequantize_fp8, weight, scale, (128, 128), torch.bfloat16)
        seconds = _timed(work, repeats)
        rows[name] = {"seconds": round(seconds, 3), "packed_mb": round(weight.numel() / 1e6, 1)}
    return rows


def _load_codes(blocks: torch.Tensor, scales: torch.Tensor, experts: int, out: int) -> None:
    """An MXFP4 stack as the loader keeps it with bfloat16 activations: codes packed for the
    int4 kernel (`KeptExperts.load_mxfp4`)."""
    kept = KeptExperts(_gpt_oss_moe(experts), GPT_OSS_HIDDEN, "silu")
    part = "gate_up_proj" if out == 2 * GPT_OSS_INTERMEDIATE else "down_proj"
    kept.load_mxfp4(part, mxfp4_codes(blocks, scales), torch.bfloat16)


def _gpt_oss_moe(num_experts: int) -> MoeConfig:
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=GPT_OSS_TOP_K,
        moe_intermediate_size=GPT_OSS_INTERMEDIATE,
        norm_topk_prob=False,
        moe_layers=(True,),
        scoring="top_logits",
        router_bias=True,
        expert_bias=True,
        clamped_swiglu=(1.702, 7.0),
    )


def _gpt_oss_experts(num_experts: int) -> tuple[Experts, KeptExperts, KeptExperts]:
    """One gpt-oss-20b layer's experts (`num_experts` of them) from random MXFP4 bytes, in
    bfloat16, as int8 groups and as MXFP4 codes: the same values."""
    moe = _gpt_oss_moe(num_experts)
    floats = Experts(moe, GPT_OSS_HIDDEN, "silu").to(torch.bfloat16)
    kept = KeptExperts(moe, GPT_OSS_HIDDEN, "silu").to(torch.bfloat16)
    codes = KeptExperts(moe, GPT_OSS_HIDDEN, "silu").to(torch.bfloat16)
    for part, (out, cols) in PART_SHAPES.items():
        blocks = torch.randint(0, 256, (num_experts, out, cols // 32, 16), dtype=torch.uint8)
        scales = torch.randint(118, 124, (num_experts, out, cols // 32), dtype=torch.uint8)
        kept.load_int8(part, *mxfp4_as_int8(blocks, scales))
        codes.load_mxfp4(part, mxfp4_codes(blocks, scales), torch.bfloat16)
        # [experts, out, in] -> the floats' [experts, in, out]
        weight = dequantize_mxfp4(blocks, scales, torch.bfloat16).transpose(1, 2)
        getattr(floats, part).data = weight.contiguous()
    _same_biases(floats, kept, codes)
    return floats, kept, codes


def _int4_experts(num_experts: int) -> tuple[Experts, KeptExperts]:
    """The same layer's shapes in a GGUF's 4-bit form (random Q4_0-like values, a float16
    scale per 32 and a min of -8 scales), in bfloat16 and as int4 groups: the same values."""
    moe = _gpt_oss_moe(num_experts)
    floats = Experts(moe, GPT_OSS_HIDDEN, "silu").to(torch.bfloat16)
    kept = KeptExperts(moe, GPT_OSS_HIDDEN, "silu").to(torch.bfloat16)
    for part, (out, cols) in PART_SHAPES.items():
        values = torch.randint(0, 256, (num_experts, out, cols // 2), dtype=torch.uint8)
        steps = (torch.rand(num_experts, out, cols // 32) * 0.01 + 0.001).half().float()
        kept.load_int4(part, values, steps, -8 * steps)
        q = torch.stack([values & 0x0F, values >> 4], dim=-1).flatten(2).float()
        weight = q * steps.repeat_interleave(32, dim=-1) - 8 * steps.repeat_interleave(32, dim=-1)
        getattr(floats, part).data = weight.to(torch.bfloat16).transpose(1, 2).contiguous()
    _same_biases(floats, kept)
    return floats, kept


def _same_biases(floats: Experts, *kept: KeptExperts) -> None:
    """Random biases for `floats`, and the same for each of `kept`."""
    with torch.no_grad():
        for name in ("gate_up_proj_bias", "down_proj_bias"):
            bias = torch.randn(getattr(floats, name).shape) * 0.02
            getattr(floats, name).copy_(bias)
            for experts in kept:
                getattr(experts, name).copy_(bias)


def measure_experts(num_experts: int, repeats: int) -> dict[str, Any]:
    """Milliseconds of one MoE layer's experts at work: bfloat16, MXFP4 codes and int8 groups
    (the same MXFP4 values) and int4 groups (a Q4 GGUF's)."""
    why_not = int8_kernel.why_not(torch.bfloat16, GPT_OSS_HIDDEN)
    if why_not is not None:
        return {"skipped": why_not}
    floats, kept, codes = _gpt_oss_experts(num_experts)
    floats4, kept4 = _int4_experts(num_experts)
    forms = {"bfloat16": floats, "mxfp4": codes, "int8": kept, "int4": kept4}
    generator = torch.Generator().manual_seed(1)
    rows: dict[str, Any] = {}
    for tokens in STEP_TOKENS:
        x = torch.randn(tokens, GPT_OSS_HIDDEN, generator=generator).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(num_experts, generator=generator)[:GPT_OSS_TOP_K]
                           for _ in range(tokens)])  # fmt: skip
        weights = torch.rand(tokens, GPT_OSS_TOP_K, generator=generator)
        with torch.no_grad():
            differences = {}
            for name, (reference, experts) in {"mxfp4": (floats, codes),
                                               "int8": (floats, kept),
                                               "int4": (floats4, kept4)}.items():  # fmt: skip
                expected = reference(x, ids, weights)
                difference = (experts(x, ids, weights) - expected).abs().max()
                differences[name] = difference / expected.abs().max()
            ms = {name: 1000 * _timed(partial(experts, x, ids, weights), repeats)
                  for name, experts in forms.items()}  # fmt: skip
        rows[f"{tokens} tokens"] = {
            "bfloat16_ms": round(ms["bfloat16"], 2),
            "mxfp4_ms": round(ms["mxfp4"], 2),
            "int8_ms": round(ms["int8"], 2),
            "int4_ms": round(ms["int4"], 2),
            "mxfp4_over_bfloat16": round(ms["mxfp4"] / ms["bfloat16"], 3),
            "mxfp4_over_int8": round(ms["mxfp4"] / ms["int8"], 3),
            "int8_over_bfloat16": round(ms["int8"] / ms["bfloat16"], 3),
            "int4_over_bfloat16": round(ms["int4"] / ms["bfloat16"], 3),
            # NOTE: bfloat16 outputs of two summation orders: a few units of its last place
            **{f"{name}_max_difference_over_max_output": float(f"{value.item():.2g}")
               for name, value in differences.items()},
        }  # fmt: skip
    per_expert = 3 * GPT_OSS_HIDDEN * GPT_OSS_INTERMEDIATE
    rows["one token reads MB"] = {
        "bfloat16": round(GPT_OSS_TOP_K * 2 * per_expert / 1e6, 1),
        "mxfp4": round(GPT_OSS_TOP_K * (per_expert // 2 + 2 * per_expert // 32) / 1e6, 1),
        "int8": round(GPT_OSS_TOP_K * (per_expert + 2 * per_expert // 32) / 1e6, 1),
        "int4": round(GPT_OSS_TOP_K * (per_expert // 2 + 4 * per_expert // 32) / 1e6, 1),
    }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--experts", type=int, default=8,
        help="experts of the gpt-oss-20b layer timed at work (32 in the model; 8 hold 0.6 GB)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    rows = measure(args.repeats)
    # NOTE: pdserve's int8 kernel runs where torch runs one thread (its own team aside)
    torch.set_num_threads(1)
    rows |= {f"gpt-oss-20b experts at work, {name}": row
             for name, row in measure_experts(args.experts, args.repeats).items()}  # fmt: skip
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
