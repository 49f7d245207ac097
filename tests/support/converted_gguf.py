"""A tiny GGUF (`support.gguf_files`) converted as pdserve prepares one, and the engine's logits
on it."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine import CacheConfig, EngineConfig, ScheduledChunk
from pdserve.engine.gguf_import import convert_gguf
from pdserve.engine.runner import ModelRunner
from support.gguf_files import TinyGgufSpec, write_tiny_gguf

PROMPT = list(range(3, 35))


def converted_tiny_gguf(tmp_path: Path, spec: TinyGgufSpec) -> Path:
    """The directory `convert_gguf` makes of a tiny GGUF written from `spec`."""
    gguf_path = write_tiny_gguf(tmp_path / "model.gguf", spec)
    out_dir = tmp_path / "converted"
    out_dir.mkdir()
    convert_gguf(gguf_path, out_dir)
    return out_dir


def prompt_logits(
    model_dir: Path, dtype: str, quantization: str
) -> tuple[ModelRunner, torch.Tensor]:
    """The runner and its logits at every position of `PROMPT`."""
    config = EngineConfig(
        model=str(model_dir),
        dtype=dtype,
        quantization=quantization,
        cache=CacheConfig(num_blocks=8),
    )
    runner = ModelRunner.load(config)
    _, every = runner.execute_with_positions(
        [ScheduledChunk(PROMPT, 0, [0, 1])], every_position=(0,)
    )
    return runner, every[0].float()
