"""Sliding windows: how many long requests a decode admits in the same KV memory, with and without
its sliding layers keeping only their window (``pdserve-decode --release-window-blocks``).

    .venv/bin/python bench/window_capacity.py                 # the table below, as text
    .venv/bin/python bench/window_capacity.py --json

No model runs and no memory is allocated: each case takes a released model's configuration
(its layers, KV heads, head size and windows, from transformers' own config classes), sizes a
decode's cache as the decode does for a memory budget (`pdserve.engine.rank_model
.window_cache_size`: the memory of ``--num-blocks`` whole blocks, shared as window slots for
``--max-num-seqs`` requests and block ids for the other layers), then grants leases for
requests of one prompt length through the decode's own admission (`LeaseManager`, with the
window slots' `SlidingKV` when released) until one is refused. Reported: leases granted each
way, and the requests that run at once (at most ``--max-num-seqs``: the leases beyond wait)
with their ratio. The same cache with every layer keeping every block is the baseline,
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from transformers import AutoConfig

from pdserve.common.errors import PdserveError
from pdserve.decode.leases import LeaseManager
from pdserve.decode.sliding_kv import SlidingKV
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.kv_cache import KVCacheLayout
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.rank_model import window_cache_size
from pdserve.engine.window_slots import WindowSlots

BLOCK_SIZE = 16
CPU = torch.device("cpu")
MAX_NEW_TOKENS = 256
# The released configurations' shapes (what the KV size depends on), in transformers' names.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma-3-1b": (
        "gemma3_text",
        {
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "hidden_size": 1152,
            "sliding_window": 512,
            "max_position_embeddings": 32768,
            "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4
            + ["sliding_attention"] * 2,
        },
    ),
    "gemma-3-4b": (
        "gemma3_text",
        {
            "num_hidden_layers": 34,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_size": 2560,
            "sliding_window": 1024,
            "max_position_embeddings": 131072,
            "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5
            + ["sliding_attention"] * 4,
        },
    ),
    "gpt-oss-20b": (
        "gpt_oss",
        {
            "num_hidden_layers": 24,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "hidden_size": 2880,
            "sliding_window": 128,
            "max_position_embeddings": 131072,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
        },
    ),
}


def model_config(name: str) -> ModelConfig:
    kind, shape = MODELS[name]
    return ModelConfig.from_hf_config(AutoConfig.for_model(kind, **shape).to_dict())


def admitted(
    config: ModelConfig, memory_gib: float, prompt_tokens: int, max_seqs: int, release: bool
) -> dict[str, int]:
    """Leases for `prompt_tokens`-token requests a decode with `memory_gib` of bf16 KV grants
    before one is refused."""
    layout = KVCacheLayout(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        BLOCK_SIZE,
        "bfloat16",
    )
    num_blocks = int(memory_gib * 2**30) // layout.total_block_nbytes
    engine = EngineConfig(
        model="-",
        cache=CacheConfig(block_size=BLOCK_SIZE, max_seqs=max_seqs, release_window_blocks=release),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_seqs),
        max_model_len=prompt_tokens + MAX_NEW_TOKENS,
    )
    size = window_cache_size(engine, config, num_blocks)
    sliding = None
    if size is not None:
        slots = WindowSlots(size.num_window_slots, size.num_blocks, device=CPU)
        sliding = SlidingKV(slots, config.widest_window, BLOCK_SIZE)
        num_blocks = size.num_blocks
    leases = LeaseManager(
        BlockPool(num_blocks), BLOCK_SIZE, reserve_tokens=32, ttl_s=60.0, sliding=sliding
    )
    count = 0
    while True:
        try:
            leases.allocate(f"r{count}", prompt_tokens, MAX_NEW_TOKENS, prefill_instance_id="p")
        except PdserveError:
            break
        count += 1
    return {
        "block_ids": num_blocks,
        "window_slots": 0 if size is None else size.num_window_slots,
        "admitted": count,
        "running": min(count, max_seqs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory-gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for name in MODELS:
        config = model_config(name)
        for memory in args.memory_gib:
            for prompt in args.prompt_tokens:
                if prompt + MAX_NEW_TOKENS > config.max_position_embeddings:
                    continue
                whole = admitted(config, memory, prompt, args.max_num_seqs, release=False)
                windowed = admitted(config, memory, prompt, args.max_num_seqs, release=True)
                ratio = windowed["running"] / whole["running"] if whole["running"] else 0.0
                rows.append(
                    {
                        "model": name,
                        "memory_gib": memory,
                        "prompt_tokens": prompt,
                        "whole": whole,
                        "windowed": windowed,
                        "ratio": round(ratio, 2),
                    }
                )
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"max_num_seqs={args.max_num_seqs} block_size={BLOCK_SIZE} bf16 KV")
    print(
        "| model | KV memory | prompt | every block: leases, running | window slots: leases, "
        "running (slots, block ids) | running, ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        whole, windowed = row["whole"], row["windowed"]
        print(
            f"| {row['model']} | {row['memory_gib']:g} GiB | {row['prompt_tokens']:,} | "
            f"{whole['admitted']}, {whole['running']} | {windowed['admitted']}, "
            f"{windowed['running']} ({windowed['window_slots']:,}, {windowed['block_ids']:,}) | "
            f"{row['ratio']:.2f}x |"
        )


if __name__ == "__main__":
    main()
