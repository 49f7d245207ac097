"""Helpers shared by the benchmarks: random mid-size checkpoints and result files."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(
    os.environ.get("PDSERVE_BENCH_RESULTS_DIR") or Path(__file__).resolve().parent / "results"
)
"""Where results go: bench/results/, or ``$PDSERVE_BENCH_RESULTS_DIR`` (tools/gpu_check.py)."""


def build_random_llama(
    path: Path, *, num_layers: int = 8, hidden_size: int = 512, vocab_size: int = 2048
) -> Path:
    """Writes a random Llama checkpoint (transformers, a dev dependency) unless present."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 11 // 4,
        num_hidden_layers=num_layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def write_results(name: str, results: dict[str, Any]) -> Path:
    """Writes `results` as JSON to bench/results/<name>-<timestamp>.json."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    return path


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q) - 1))]
