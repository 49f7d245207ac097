"""Tiny checkpoints (built with transformers from a config), engine factories and prompts.

Tests that take an ``arch`` argument run once per architecture in ``ARCHITECTURES``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.tiny_models import ARCHITECTURES, EAGER_ONLY, VOCAB_SIZE, build_hf_model

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, ModelRunner, SchedulerConfig


def make_prompts(num: int, seed: int = 0, min_len: int = 5, max_len: int = 40) -> list[list[int]]:
    """Deterministic random prompts of varied lengths."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=generator).tolist()
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "arch" in metafunc.fixturenames:
        metafunc.parametrize("arch", sorted(ARCHITECTURES))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Returns ``make(name) -> model directory``, saving each architecture once per session."""
    saved: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in saved:
            path = tmp_path_factory.mktemp(name)
            build_hf_model(name).save_pretrained(path, safe_serialization=True)
            saved[name] = path
        return saved[name]

    return make


@pytest.fixture(scope="session")
def hf_model(checkpoint: Callable[[str], Path]) -> Callable[[str], torch.nn.Module]:
    """Returns ``load(name, dtype=torch.float32) -> transformers model`` read back from the
    saved checkpoint."""
    loaded: dict[tuple[str, torch.dtype], torch.nn.Module] = {}

    def load(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        if (name, dtype) not in loaded:
            from transformers import AutoModelForCausalLM

            kind = ARCHITECTURES[name][0]
            model = AutoModelForCausalLM.from_pretrained(
                checkpoint(name),
                dtype=dtype,
                attn_implementation="eager" if kind in EAGER_ONLY else "sdpa",
            )
            loaded[name, dtype] = model.eval()
        return loaded[name, dtype]

    return load


@pytest.fixture
def make_engine(checkpoint: Callable[[str], Path]) -> Callable[..., LLMEngine]:
    """Returns ``make(name="llama3", num_blocks=128, block_size=16, **settings) -> LLMEngine``
    (float32 unless ``dtype`` says otherwise: the tests compare with float32 transformers)."""

    def make(
        name: str = "llama3",
        *,
        num_blocks: int = 128,
        block_size: int = 16,
        enable_prefix_caching: bool = False,
        dtype: str = "float32",
        max_model_len: int | None = None,
        runner: ModelRunner | None = None,
        linear_backend: str = "auto",
        quantization: str = "none",
        **scheduler: Any,
    ) -> LLMEngine:
        config = EngineConfig(
            model=str(checkpoint(name)),
            dtype=dtype,
            linear_backend=linear_backend,
            quantization=quantization,
            max_model_len=max_model_len,
            seed=0,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(**scheduler),
        )
        return LLMEngine(config, runner=runner)

    return make


@pytest.fixture
def prompts() -> Callable[..., list[list[int]]]:
    """Returns ``make_prompts(num, seed=0, min_len=5, max_len=40)``."""
    return make_prompts
