"""CUDA paths: SDPA and flash-attn over the paged cache (skipped without a GPU)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from pdserve.engine import LLMEngine, ModelRunner, ScheduledChunk
from pdserve.engine.flash_attention import FLASH

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
HAS_FLASH_ATTN = FLASH is not None

EngineFactory = Callable[..., LLMEngine]
PromptFactory = Callable[..., list[list[int]]]


def mixed_batch_logits(runner: ModelRunner, sequences: list[list[int]]) -> torch.Tensor:
    """Prefill half of each sequence, then one step mixing chunks on cached KV and decodes."""
    block_size = runner.block_size
    per_seq = -(-max(len(s) for s in sequences) // block_size)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(sequences))]
    half = [len(s) // 2 for s in sequences]
    runner.execute(
        [ScheduledChunk(s[:h], 0, t) for s, h, t in zip(sequences, half, tables, strict=True)]
    )
    chunks = []
    for index, (sequence, start, table) in enumerate(zip(sequences, half, tables, strict=True)):
        end = start + 1 if index % 2 else len(sequence)  # odd rows decode, even rows prefill
        chunks.append(ScheduledChunk(sequence[start:end], start, table))
    return runner.execute(chunks)


def cuda_engine(make_engine: EngineFactory, backend: str, block_size: int = 256) -> LLMEngine:
    engine = make_engine(
        "mistral", dtype="bfloat16", num_blocks=4096 // block_size, block_size=block_size
    )
    return LLMEngine(replace(engine.config, device="cuda", attention_backend=backend))


def test_cuda_sdpa_matches_cpu(make_engine: EngineFactory, prompts: PromptFactory) -> None:
    sequences = prompts(4, seed=70, min_len=40, max_len=90)
    gpu = mixed_batch_logits(cuda_engine(make_engine, "sdpa").runner, sequences).cpu()
    cpu_engine = make_engine("mistral", dtype="bfloat16", num_blocks=16, block_size=256)
    cpu = mixed_batch_logits(cpu_engine.runner, sequences)
    torch.testing.assert_close(gpu, cpu, atol=0.1, rtol=0)


@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="needs flash-attn")
@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_attn_matches_sdpa(
    make_engine: EngineFactory, prompts: PromptFactory, block_size: int
) -> None:
    assert FLASH is not None
    if block_size % FLASH.block_size_multiple:
        pytest.skip(f"{FLASH.name} pages are multiples of {FLASH.block_size_multiple}")
    sequences = prompts(4, seed=71, min_len=40, max_len=90)
    engine = cuda_engine(make_engine, "flash", block_size)
    assert engine.runner.attention_backend == FLASH.name
    flash = mixed_batch_logits(engine.runner, sequences)
    sdpa = mixed_batch_logits(cuda_engine(make_engine, "sdpa", block_size).runner, sequences)
    torch.testing.assert_close(flash, sdpa, atol=0.05, rtol=0)


def test_cuda_export_import_round_trip(make_engine: EngineFactory) -> None:
    engine = cuda_engine(make_engine, "sdpa")
    cache = engine.kv_cache
    cache.kv.copy_(torch.randn_like(cache.kv))
    data = cache.export_blocks(1, [4, 2])
    cache.import_blocks(0, [7, 9], data.k, data.v)
    assert torch.equal(cache.kv[0, :, 7], cache.kv[1, :, 4])
    assert torch.equal(cache.kv[0, :, 9], cache.kv[1, :, 2])
