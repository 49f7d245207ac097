"""Helpers shared by the benchmarks: random mid-size checkpoints and result files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
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


@contextlib.contextmanager
def server_logs(prefix: str) -> Iterator[Path]:
    """A fresh folder for the logs of the servers a bench starts: removed when the bench
    ends well, kept (and named on stderr) when it fails, to read why."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        print(f"the servers' logs: {path}", file=sys.stderr, flush=True)
        raise
    shutil.rmtree(path, ignore_errors=True)


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


def cpu_description() -> dict[str, Any]:
    """This machine's CPU model and its SIMD / matrix flags (AVX2, AVX-512, AMX) from
    ``/proc/cpuinfo``, and torch's CPU capability: what the CPU numbers depend on."""
    import torch

    model, flags = "unknown", []
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags":
                flags = sorted(f for f in value.split() if f.startswith(("avx", "amx", "fma")))
                break
    return {
        "cpu": model,
        "flags": flags,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "num_cpus": os.cpu_count(),
    }


def prefilled_streams(
    model_dir: Path,
    num_streams: int,
    prompt_len: int,
    num_steps: int,
    block_size: int,
    dtype: str = "auto",
    quantization: str = "none",
) -> tuple[Any, list[list[int]], list[list[int]]]:
    """A one-thread runner on `model_dir` with `num_streams` random prompts of `prompt_len`
    tokens prefilled into the paged cache, room left for `num_steps` tokens more each:
    (runner, token ids of each stream, block table of each stream)."""
    import torch

    from pdserve.engine.batch import ScheduledChunk
    from pdserve.engine.config import CacheConfig, EngineConfig
    from pdserve.engine.load_runner import load_runner

    torch.set_num_threads(1)
    blocks_per_seq = (prompt_len + num_steps + block_size) // block_size + 1
    config = EngineConfig(
        model=str(model_dir),
        dtype=dtype,
        quantization=quantization,
        num_threads=1,
        cache=CacheConfig(block_size=block_size, num_blocks=num_streams * blocks_per_seq),
    )
    runner = load_runner(config)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_streams)]
    generator = torch.Generator().manual_seed(0)
    sequences = [
        torch.randint(100, 40000, (prompt_len,), generator=generator).tolist()
        for _ in range(num_streams)
    ]
    for sequence, table in zip(sequences, tables, strict=True):
        runner.execute([ScheduledChunk(sequence, 0, table)])
    return runner, sequences, tables
