"""Tiny checkpoints (built with transformers from a config), engine factories and prompts.

Tests that take an ``arch`` argument run once per architecture in ``ARCHITECTURES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, ModelRunner, SchedulerConfig

VOCAB_SIZE = 300
# NOTE: a wide initializer spreads the logits, so greedy choices are not near-ties that a
# last-bit difference between two correct implementations could flip.
INIT_RANGE = 0.25

COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "initializer_range": INIT_RANGE,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA, untied, Llama 3.1 rope scaling with a short original context so it matters.
    "llama3": (
        "llama",
        {
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    # Multi-head attention with tied embeddings.
    "llama_tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    # q/k/v bias, GQA, tied embeddings (as the small Qwen2 checkpoints are).
    "qwen2": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    # One KV head for four query heads and a sliding window shorter than the test sequences.
    "mistral": ("mistral", {"num_key_value_heads": 1, "sliding_window": 24}),
}


def build_hf_model(name: str) -> torch.nn.Module:
    """A random transformers model of one of ``ARCHITECTURES``, in eval mode."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    kind, extra = ARCHITECTURES[name]
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[kind]
    config = config_cls(**COMMON, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(sorted(ARCHITECTURES).index(name))
    model = model_cls(config)
    if kind == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0.0, INIT_RANGE)
    return model.eval()


def make_prompts(num: int, seed: int = 0, min_len: int = 5, max_len: int = 40) -> list[list[int]]:
    """Deterministic random prompts of varied lengths."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=generator).tolist()
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    """Runs each engine test on one intra-op thread.

    The tiny models gain nothing from more threads, and on a busy two-core machine OpenMP
    barriers between two threads make every small kernel wait for the other core.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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

            model = AutoModelForCausalLM.from_pretrained(
                checkpoint(name), dtype=dtype, attn_implementation="sdpa"
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
