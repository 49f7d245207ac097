"""The engine's model against transformers: logits and greedy tokens, per architecture."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.hf_reference import hf_greedy

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, ScheduledChunk
from pdserve.engine.model import Linear

# fp32 on CPU: both sides use the same kernels up to fused projections and summation order.
LOGITS_ATOL = 1e-4
NUM_NEW_TOKENS = 40

EngineFactory = Callable[..., LLMEngine]
ModelFactory = Callable[[str], torch.nn.Module]
PromptFactory = Callable[..., list[list[int]]]


def test_greedy_tokens_match_transformers(
    arch: str, make_engine: EngineFactory, hf_model: ModelFactory, prompts: PromptFactory
) -> None:
    engine = make_engine(arch)
    batch = prompts(3, seed=11, min_len=10, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = engine.generate(batch, params)
    for prompt, output in zip(batch, outputs, strict=True):
        assert len(output) == NUM_NEW_TOKENS
        assert output == hf_greedy(hf_model(arch), prompt, NUM_NEW_TOKENS)


def test_logits_match_transformers_at_every_position(
    arch: str, make_engine: EngineFactory, hf_model: ModelFactory, prompts: PromptFactory
) -> None:
    """Prefill a prompt, then feed the rest one token at a time; compare each position."""
    engine = make_engine(arch)
    sequence = prompts(1, seed=5, min_len=60, max_len=60)[0]
    with torch.no_grad():
        reference = hf_model(arch)(torch.tensor([sequence])).logits[0]
    num_prompt = 20
    block_ids = engine.block_pool.allocate(4)
    ours = [engine.runner.execute([ScheduledChunk(sequence[:num_prompt], 0, block_ids)])[0]]
    for position in range(num_prompt, len(sequence)):
        chunk = ScheduledChunk([sequence[position]], position, block_ids)
        ours.append(engine.runner.execute([chunk])[0])
    torch.testing.assert_close(
        torch.stack(ours), reference[num_prompt - 1 :], atol=LOGITS_ATOL, rtol=0
    )


def test_mistral_sliding_window_changes_attention(
    make_engine: EngineFactory, hf_model: ModelFactory, prompts: PromptFactory
) -> None:
    """The window (24) is shorter than the sequence, so ignoring it would change the logits."""
    engine = make_engine("mistral")
    sequence = prompts(1, seed=9, min_len=50, max_len=50)[0]
    logits = engine.runner.execute([ScheduledChunk(sequence, 0, engine.block_pool.allocate(4))])[0]
    model = hf_model("mistral")
    with torch.no_grad():
        windowed = model(torch.tensor([sequence])).logits[0, -1]
        window = model.config.sliding_window
        model.config.sliding_window = None
        try:
            full = model(torch.tensor([sequence])).logits[0, -1]
        finally:
            model.config.sliding_window = window
    torch.testing.assert_close(logits, windowed, atol=LOGITS_ATOL, rtol=0)
    assert (logits - full).abs().max() > 100 * LOGITS_ATOL


def test_bfloat16_runs_close_to_float32(make_engine: EngineFactory, prompts: PromptFactory) -> None:
    sequence = prompts(1, seed=3, min_len=30, max_len=30)[0]
    logits = {}
    for dtype in ("float32", "bfloat16"):
        engine = make_engine("llama3", dtype=dtype)
        assert engine.kv_cache.kv.dtype == getattr(torch, dtype)
        chunk = ScheduledChunk(sequence, 0, engine.block_pool.allocate(2))
        logits[dtype] = engine.runner.execute([chunk])[0]
    assert logits["bfloat16"].dtype == torch.float32
    error = (logits["bfloat16"] - logits["float32"]).abs().max()
    assert 0 < error < 0.25


def test_onednn_packed_projections_equal_torch_gemm(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    # The CPU default packs every projection for oneDNN; torch's GEMM is the fallback.
    packed, plain = make_engine(linear_backend="auto"), make_engine(linear_backend="torch")
    linears = [m for m in packed.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    plain_linears = [m for m in plain.runner.model.modules() if isinstance(m, Linear)]
    assert all(m.packed_weight is None for m in plain_linears)
    batch = prompts(3, seed=21, min_len=5, max_len=40)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert packed.generate(batch, params) == plain.generate(batch, params)
    chunk = [ScheduledChunk(batch[0], 0, packed.block_pool.allocate(4))]
    torch.testing.assert_close(
        packed.runner.execute(chunk), plain.runner.execute(chunk), atol=LOGITS_ATOL, rtol=0
    )


def test_a_sharded_checkpoint_loads_like_a_single_file(
    tmp_path: Path, hf_model: ModelFactory, make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    # Experts spread over many shards: a stacked expert tensor is filled from several files.
    sharded = tmp_path / "sharded"
    hf_model("qwen3_moe").save_pretrained(sharded, max_shard_size="40KB")
    assert len(list(sharded.glob("*.safetensors"))) > 4
    assert (sharded / "model.safetensors.index.json").is_file()
    engine = make_engine("qwen3_moe")
    config = EngineConfig(
        model=str(sharded), dtype="float32", seed=0, cache=CacheConfig(num_blocks=32)
    )
    from_shards = LLMEngine(config)
    sequence = prompts(1, seed=4, min_len=30, max_len=30)[0]
    logits = [
        e.runner.execute([ScheduledChunk(sequence, 0, e.block_pool.allocate(2))])[0]
        for e in (engine, from_shards)
    ]
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)


def test_a_checkpoint_missing_an_expert_is_refused(
    tmp_path: Path, checkpoint: Callable[[str], Path]
) -> None:
    from safetensors.torch import load_file, save_file

    source = checkpoint("mixtral")
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks parameters: \['model.layers.1.mlp.experts"):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32", cache=CacheConfig(num_blocks=8)))


def test_gpt_oss_clamped_swiglu_equals_transformers_on_values_past_the_limit() -> None:
    """The tiny models' activations stay small; here gate and up reach well past the limit."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from pdserve.engine.arch_config import MoeConfig
    from pdserve.engine.moe import Experts

    config = GptOssConfig(hidden_size=8, intermediate_size=6, num_local_experts=2, swiglu_limit=1.5)
    theirs = GptOssExperts(config)
    moe = MoeConfig(2, 1, 6, False, (True,), clamped_swiglu=(config.swiglu_alpha, 1.5))
    ours = Experts(moe, 8, "silu")
    # interleaved: [gate0, up0, gate1, up1, ...], as the checkpoint stores them
    gate_up = torch.randn(5, 12, generator=torch.Generator().manual_seed(0)) * 4
    want = theirs._apply_gate(gate_up)
    got = ours._activation(gate_up[:, ::2], gate_up[:, 1::2])
    assert (gate_up.abs() > 1.5).any()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
