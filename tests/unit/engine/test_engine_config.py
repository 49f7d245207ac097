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
        lambda: ModelConfig.from_hf_config({**HF, "num_key_value_heads": 3}),
        lambda: ModelConfig.from_hf_config({**HF, "model_type": "gpt2"}),
        lambda: ModelConfig.from_hf_config({**HF, "hidden_act": "gelu"}),
        lambda: ModelConfig.from_hf_config({**HF, "rope_scaling": {"rope_type": "yarn"}}),
    ],
)
def test_bad_settings_raise_value_error(build: Any) -> None:
    with pytest.raises(ValueError):
        build()


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
