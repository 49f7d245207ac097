"""The Hugging Face ``config.json`` a GGUF file's ``{arch}.*`` metadata describes, per
architecture (`gguf_architectures` holds the tensor side)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from pdserve.engine.gguf_architectures import architecture_rules
from pdserve.engine.gguf_rope import llama3_rope_scaling

# NOTE: llama.cpp hardcodes Gemma 3's layer pattern (five sliding-window layers, then a global
# one) and the sliding layers' RoPE base; newer files may state them, older ones do not.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_NUM_LAYERS = 62
# NOTE: llama.cpp hardcodes SmolLM3's layers without RoPE: every fourth.
SMOLLM3_NO_ROPE_LAYER_INTERVAL = 4

ConfigGetter = Callable[..., Any]
"""Reads ``{arch}.<key>`` from the metadata: ``get(key, default=None)``; raises if absent."""


def hf_config(
    metadata: Mapping[str, Any], tensor_names: set[str], rope_freqs: np.ndarray | None = None
) -> dict[str, Any]:
    """The Hugging Face ``config.json`` object the GGUF metadata describes.

    Args:
        metadata: The file's metadata as plain values.
        tensor_names: The names of the file's tensors.
        rope_freqs: The ``rope_freqs.weight`` tensor, if the file has one: llama.cpp's form of
            Llama 3's RoPE scaling.

    Raises:
        ValueError: For an architecture or setting pdserve does not implement.
    """
    rules = architecture_rules(metadata)
    arch = str(metadata["general.architecture"])
    refused = {
        "rope_factors_long.weight": "GGUF LongRoPE factors (rope_factors_long) are not supported",
    }
    for name, message in refused.items():
        if name in tensor_names:
            raise ValueError(message)

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"the GGUF file lacks {arch}.{key}")
        return value

    num_heads = int(get("attention.head_count"))
    hidden_size = int(get("embedding_length"))
    vocab_size = metadata.get(f"{arch}.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "architectures": [rules.hf_class],
        "model_type": rules.model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden_size // num_heads)),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch not in ("qwen2", "qwen2moe") and "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"unsupported GGUF RoPE scaling {scaling!r}; supported: linear")
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(get("rope.scaling.factor")),
        }
    if "rope_freqs.weight" in tensor_names:
        if arch != "llama" or rope_freqs is None or "rope_scaling" in config:
            raise ValueError(
                "GGUF per-frequency RoPE factors (rope_freqs) are supported on llama files only, "
                "as Llama 3's RoPE scaling"
            )
        rotary_dim = int(get("rope.dimension_count", config["head_dim"]))
        scaling = llama3_rope_scaling(rope_freqs, config["rope_theta"], rotary_dim)
        if scaling is not None:
            config["rope_scaling"] = scaling
    for key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        value = metadata.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[key] = int(value)
    extra = _FAMILY_CONFIGS.get(rules.model_type)
    if extra is not None:
        extra(config, get)
    return config


def _mixtral_config(config: dict[str, Any], get: ConfigGetter) -> None:
    config["num_local_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))


def _qwen2_moe_config(config: dict[str, Any], get: ConfigGetter) -> None:
    config["num_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    # NOTE: the converter writes no expert_weights_norm for Qwen2-MoE; llama.cpp then leaves
    # the top-k routing weights as the softmax gives them.
    config["norm_topk_prob"] = bool(get("expert_weights_norm", False))
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = []


def _qwen3_moe_config(config: dict[str, Any], get: ConfigGetter) -> None:
    config["num_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    # NOTE: llama.cpp always renormalizes Qwen3-MoE's top-k routing weights.
    config["norm_topk_prob"] = bool(get("expert_weights_norm", True))
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = []


def _gemma3_config(config: dict[str, Any], get: ConfigGetter) -> None:
    num_layers = config["num_hidden_layers"]
    del config["hidden_act"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["sliding_window"] = int(get("attention.sliding_window"))
    config["rope_local_base_freq"] = float(get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
    # NOTE: llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B model (62 layers),
    # which uses hidden_size / num_heads, as its Hugging Face config does.
    scalar = config["head_dim"]
    if num_layers == GEMMA3_27B_NUM_LAYERS:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    config["query_pre_attn_scalar"] = scalar
    softcap = get("final_logit_softcapping", 0.0)
    config["final_logit_softcapping"] = float(softcap) if softcap else None
    pattern = get("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):
        # one flag per layer, true for a sliding-window layer
        is_sliding = [bool(flag) for flag in pattern]
    else:
        config["sliding_window_pattern"] = int(pattern)
        is_sliding = [(layer + 1) % int(pattern) != 0 for layer in range(num_layers)]
    config["layer_types"] = [
        "sliding_attention" if sliding else "full_attention" for sliding in is_sliding
    ]


def _olmo2_config(config: dict[str, Any], get: ConfigGetter) -> None:
    # NOTE: llama.cpp's converter writes OLMo 3 as an olmo2 file with sliding-window layers.
    if get("attention.sliding_window", 0):
        raise ValueError(
            "an olmo2 GGUF file with a sliding window (OLMo 3) is not supported; "
            "OLMo 2 is (no attention.sliding_window)"
        )


def _smollm3_config(config: dict[str, Any], get: ConfigGetter) -> None:
    interval = SMOLLM3_NO_ROPE_LAYER_INTERVAL
    config["no_rope_layer_interval"] = interval
    config["no_rope_layers"] = [
        int((layer + 1) % interval != 0) for layer in range(config["num_hidden_layers"])
    ]


def _phi3_config(config: dict[str, Any], get: ConfigGetter) -> None:
    del config["head_dim"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        config["partial_rotary_factor"] = rotary_dim / head_dim
    config["sliding_window"] = get("attention.sliding_window", 0) or None
    config["original_max_position_embeddings"] = int(
        get("rope.scaling.original_context_length", config["max_position_embeddings"])
    )


_FAMILY_CONFIGS = {
    "mixtral": _mixtral_config,
    "qwen2_moe": _qwen2_moe_config,
    "qwen3_moe": _qwen3_moe_config,
    "gemma3_text": _gemma3_config,
    "phi3": _phi3_config,
    "olmo2": _olmo2_config,
    "smollm3": _smollm3_config,
}
