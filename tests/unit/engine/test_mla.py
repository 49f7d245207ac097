"""Multi-head latent attention (DeepSeek-V3): the cache holds each token's latent and nothing
more, at DeepSeek-V3's own latent sizes."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.model_config import ModelConfig


def test_a_token_holds_576_values_per_layer_at_deepseek_v3_latent_sizes(tmp_path: Path) -> None:
    """kv_lora_rank 512 and qk_rope_head_dim 64 as DeepSeek-V3 (fewer heads, layers and
    experts): a block's K and V hold the latent's two halves, 576 values per token and layer,
    where per-head K and V would hold 128 x (192 + 128); and the engine generates on it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=300,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        moe_intermediate_size=64,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model_config = ModelConfig.from_pretrained(tmp_path)
    assert (model_config.cache_num_kv_heads, model_config.cache_head_dim) == (1, 288)
    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path),
            dtype="bfloat16",
            seed=0,
            cache=CacheConfig(block_size=16, num_blocks=8),
        )
    )
    layout = engine.kv_cache.layout
    per_token_layer = layout.total_block_nbytes // layout.num_layers // layout.block_size
    assert per_token_layer == 576 * 2  # bfloat16
    # NOTE: per-head K (192) and V (128) of DeepSeek-V3's 128 heads: 71x the latent's bytes.
    assert round(128 * (128 + 64 + 128) * 2 / per_token_layer) == 71
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert len(engine.generate([[5, 17, 42, 99]], greedy)[0]) == 8
