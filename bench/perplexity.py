"""Perplexity of the engine on a fixed text per dtype and quantization, in the same run.

    python bench/perplexity.py                       # the default model, bench/data/perplexity.txt
    python bench/perplexity.py --model smollm2-135m-instruct --threads 1
    python bench/perplexity.py --settings float32+none,float32+auto,float32+auto:every-row

The text (a few hundred tokens, committed in the repository) is run as one prompt through the
engine's model on its paged KV cache; every position's logits score the next token. Each
setting's perplexity is compared with bfloat16's (the quantized forms run bf16 activations) and
with float32's (the file's values exactly, for a GGUF). The goal for int8 / int4 re-quantized
from the floats is within 2% of bfloat16; for ``auto`` (a GGUF's int4 weights kept as the file
stores them) within 0.5% of the same file dequantized.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from common import write_results

from pdserve.common.generation import num_blocks_for
from pdserve.engine import CacheConfig, EngineConfig, int4_kernel, int8_kernel
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model
from pdserve.engine.quant import Int4Linear, Int8GroupLinear, weight_bytes
from pdserve.engine.runner import ModelRunner
from pdserve.tokenizer import Tokenizer

TEXT = Path(__file__).parent / "data" / "perplexity.txt"
SETTINGS = (
    ("float32", "none"),
    ("bfloat16", "none"),
    # NOTE: a GGUF's Q4_0 / Q4_1 / Q4_K weights (and a Q8_0 LM head) as the file stores them: a
    # prompt this long runs one bf16 GEMM over them dequantized (pdserve's kernels) or torch's
    # int4 kernel (``:torch``); ``:every-row`` runs pdserve's int4 and int8 kernels on every
    # row, as a decode step does; ``:bf16-head`` dequantizes the Q8_0 LM head to bf16.
    ("bfloat16", "auto"),
    ("bfloat16", "auto:every-row"),
    ("bfloat16", "auto:bf16-head"),
    ("bfloat16", "auto:torch"),
    ("bfloat16", "int8"),
    ("bfloat16", "int4"),
    ("float32", "int8"),
    # NOTE: the same kept weights with float32 activations (pdserve's AVX2 kernels).
    ("float32", "auto"),
    ("float32", "auto:every-row"),
)
BLOCK_SIZE = 16


def perplexity(runner: ModelRunner, token_ids: list[int]) -> float:
    """``exp`` of the mean negative log-likelihood of tokens 1.. given their prefixes."""
    block_ids = list(range(num_blocks_for(len(token_ids), BLOCK_SIZE)))
    chunk: ScheduledChunk[Any] = ScheduledChunk(token_ids, 0, block_ids)
    _, every = runner.execute_with_positions([chunk], every_position=[0])
    # logits: [num_tokens, vocab]; row j predicts token j + 1
    logits = every[0][:-1].float()
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits, targets)
    return math.exp(float(nll))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--settings",
        default=",".join(f"{d}+{q}" for d, q in SETTINGS),
        help="comma-separated dtype+quantization to run (float32+none is the reference)",
    )
    args = parser.parse_args()
    settings = [tuple(item.split("+", 1)) for item in args.settings.split(",")]
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model).path
    token_ids = Tokenizer.from_pretrained(model_dir).encode(args.text.read_text())
    rows: list[dict[str, Any]] = []
    for dtype, quantization in settings:
        how = quantization.partition(":")[2]
        config = EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            quantization=quantization.partition(":")[0],
            cache=CacheConfig(
                block_size=BLOCK_SIZE, num_blocks=num_blocks_for(len(token_ids), BLOCK_SIZE)
            ),
        )
        kernel_choice: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if how == "torch":
            kernel_choice = mock.patch.object(int4_kernel, "takes", return_value=False)
        elif how == "bf16-head":
            kernel_choice = mock.patch.object(int8_kernel, "why_not", return_value="bench")
        with kernel_choice:
            runner = ModelRunner.load(config)
        if how == "every-row":
            for module in runner.model.modules():
                if isinstance(module, (Int4Linear, Int8GroupLinear)):
                    # NOTE: as under --deterministic: every row count on the int4/int8 kernel.
                    module.min_rows = 2
        value = perplexity(runner, token_ids)
        rows.append(
            {
                "dtype": dtype,
                "quantization": quantization,
                "perplexity": value,
                "weight_mb": weight_bytes(runner.model) / 1e6,
            }
        )
        del runner
    by_key = {(r["dtype"], r["quantization"]): r["perplexity"] for r in rows}
    fp32 = by_key[("float32", "none")]
    bf16 = by_key.get(("bfloat16", "none"), math.nan)
    print(f"{args.model}: {len(token_ids)} tokens of {args.text.name}, threads={args.threads}\n")
    print("| dtype | quantization | weights MB | perplexity | vs bfloat16 | vs float32 |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        row["vs_bfloat16"] = row["perplexity"] / bf16 - 1
        row["vs_float32"] = row["perplexity"] / fp32 - 1
        print(
            f"| {row['dtype']} | {row['quantization']} | {row['weight_mb']:.0f} | "
            f"{row['perplexity']:.3f} | {row['vs_bfloat16']:+.2%} | {row['vs_float32']:+.2%} |"
        )
    path = write_results(
        "perplexity",
        {"model": args.model, "text": args.text.name, "num_tokens": len(token_ids), "rows": rows},
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
