"""Config validation and reading Hugging Face configs in both rope formats."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig

HF: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "eos_token_id": [2, 9],
}


@pytest.mark.parametrize(
    "build",
    [
        lambda: SamplingParams(temperature=-1),
        lambda: SamplingParams(top_p=0),
        lambda: SamplingParams(top_k=-1),
        lambda: SamplingParams(max_tokens=0),
        lambda: SamplingParams(seed=-3),
        lambda: CacheConfig(block_size=0),
        lambda: CacheConfig(num_blocks=0),
        lambda: CacheConfig(dtype="int8"),
        lambda: SchedulerConfig(max_num_seqs=0),
        lambda: SchedulerConfig(max_num_batched_tokens=0),
        lambda: EngineConfig(model=""),
        lambda: EngineConfig(model="m", dtype="float64"),
        lambda: EngineConfig(model="m", attention_backend="xformers"),
        lambda: EngineConfig(model="m", quantization="int2"),
        lambda: EngineConfig(model="m", device="cuda", quantization="int8"),
        lambda: EngineConfig(model="m", device="nonsense"),
        lambda: EngineConfig(model="m", num_threads=0),
        lambda: EngineConfig(model="m", quantization="int8", tensor_parallel_size=2),
        lambda: ModelConfig.from_hf_config({**HF, "num_key_value_heads": 3}),
        lambda: ModelConfig.from_hf_config({**HF, "model_type": "gpt2"}),
        lambda: ModelConfig.from_hf_config({**HF, "hidden_act": "gelu"}),
        lambda: ModelConfig.from_hf_config({**HF, "rope_scaling": {"rope_type": "longrope"}}),
    ],
)
def test_bad_settings_raise_value_error(build: Any) -> None:
    with pytest.raises(ValueError):
        build()


def test_auto_quantization_is_accepted_where_int4_kernels_do_not_run() -> None:
    """``auto`` (the default) dequantizes a GGUF's int4 weights on a GPU or over several ranks
    instead of refusing, as ``int8`` / ``int4`` do."""
    assert EngineConfig(model="m", device="cuda").quantization == "auto"
    assert EngineConfig(model="m", tensor_parallel_size=2).quantization == "auto"


def test_configs_are_frozen() -> None:
    params = SamplingParams(stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert params.stop_token_ids == (3, 4)
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]


def test_legacy_and_current_rope_formats_agree() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    legacy = ModelConfig.from_hf_config(
        {**HF, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    current = ModelConfig.from_hf_config(
        {**HF, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", **scaling}}
    )
    assert legacy.rope == current.rope
    assert current.rope.theta == 500000.0 and current.rope.rope_type == "llama3"
    assert current.head_dim == 16 and current.num_queries_per_kv == 2
    assert current.eos_token_ids == (2, 9)


def test_architecture_specific_settings() -> None:
    qwen = ModelConfig.from_hf_config(
        {**HF, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    )
    assert qwen.qkv_bias and not qwen.o_proj_bias and qwen.sliding_window(0) is None
    mistral = ModelConfig.from_hf_config({**HF, "model_type": "mistral", "sliding_window": 24})
    assert mistral.sliding_window(1) == 24 and not mistral.qkv_bias
    llama = ModelConfig.from_hf_config({**HF, "attention_bias": True})
    assert llama.qkv_bias and llama.o_proj_bias


def test_family_settings_are_read_from_their_configs() -> None:
    qwen3 = ModelConfig.from_hf_config({**HF, "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias and qwen3.moe is None
    phi3 = ModelConfig.from_hf_config(
        {**HF, "model_type": "phi3", "partial_rotary_factor": 0.75, "sliding_window": 2047}
    )
    assert phi3.rotary_dim == 12 and phi3.sliding_windows == (2047, 2047)
    mixtral = ModelConfig.from_hf_config(
        {**HF, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    )
    assert mixtral.moe is not None and mixtral.moe.norm_topk_prob
    assert mixtral.moe.moe_intermediate_size == HF["intermediate_size"]
    assert mixtral.is_moe_layer(0) and mixtral.is_moe_layer(1)
    qwen3_moe = ModelConfig.from_hf_config(
        {
            **HF,
            "model_type": "qwen3_moe",
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [0],
        }
    )
    assert qwen3_moe.moe is not None and qwen3_moe.moe.moe_layers == (False, True)
    assert qwen3_moe.qk_norm and qwen3_moe.moe.shared_expert_intermediate_size == 0
    qwen2_moe = ModelConfig.from_hf_config(
        {
            **HF,
            "model_type": "qwen2_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 2,
        }
    )
    assert qwen2_moe.moe is not None and qwen2_moe.moe.moe_layers == (False, True)
    assert qwen2_moe.moe.shared_expert_intermediate_size == 64 and qwen2_moe.qkv_bias


def test_gemma3_reads_both_rope_formats_and_its_layer_pattern() -> None:
    gemma: dict[str, Any] = {
        **HF,
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": 64,
        "sliding_window": 512,
    }
    legacy = ModelConfig.from_hf_config(
        {
            **gemma,
            "sliding_window_pattern": 3,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        }
    )
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    current = ModelConfig.from_hf_config(
        {
            **gemma,
            "layer_types": layer_types,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        }
    )
    for config in (legacy, current):
        assert config.sliding_windows == (512, 512, None, 512, 512, None)
        assert config.rope.theta == 1e6 and config.rope.rope_type == "linear"
        assert config.local_rope is not None and config.local_rope.theta == 1e4
        assert config.local_rope.rope_type == "default"
        assert config.gemma_norms and config.qk_norm and config.tie_word_embeddings
        assert config.embed_scale == 64**0.5 and config.attention_scale == 64**-0.5
        assert config.hidden_act == "gelu_pytorch_tanh"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"model_type": "gpt_neox"}, "'gpt_neox'"),
        ({"model_type": "gemma3", "text_config": {}}, "gemma3_text"),
        ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"model_type": "phi3", "rope_scaling": {"rope_type": "longrope"}}, "'longrope'"),
        ({"model_type": "qwen3", "hidden_act": "relu"}, "'relu'"),
    ],
)
def test_an_unsupported_setting_is_refused_by_name(overrides: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError) as raised:
        ModelConfig.from_hf_config({**HF, **overrides})
    message = str(raised.value)
    assert named in message
    if "model_type" in message:
        assert "qwen3_moe" in message and "gemma3_text" in message and "mixtral" in message
