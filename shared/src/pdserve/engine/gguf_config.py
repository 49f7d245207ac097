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
# NOTE: llama.cpp hardcodes gpt-oss's clamped SwiGLU (alpha, limit) and its layer pattern
# (sliding-window layers first, then alternating with full ones).
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SLIDING_WINDOW_PATTERN = 2
# llama.cpp's expert gating functions (``{arch}.expert_gating_func``).
EXPERT_GATING_SOFTMAX, EXPERT_GATING_SIGMOID = 1, 2
# NOTE: llama.cpp's converter writes DeepSeek's YaRN mscale_all_dim as 0.1 * mscale_all_dim.
DEEPSEEK2_YARN_LOG_MUL_PER_MSCALE = 0.1

ConfigGetter = Callable[..., Any]
"""Reads ``{arch}.<key>`` from the metadata: ``get(key, default=None)``; raises if absent."""
FamilyConfig = Callable[[dict[str, Any], ConfigGetter, set[str]], None]
"""Completes the config of one family: (config, get, the file's tensor names)."""


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
        config["rope_scaling"] = _rope_scaling(str(scaling), get)
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
        extra(config, get, tensor_names)
    return config


def _rope_scaling(scaling: str, get: ConfigGetter) -> dict[str, Any]:
    """The ``rope_scaling`` of a file's ``rope.scaling.*`` keys: linear or YaRN."""
    if scaling == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if scaling != "yarn":
        raise ValueError(f"unsupported GGUF RoPE scaling {scaling!r}; supported: linear, yarn")
    extrapolation = float(get("rope.scaling.yarn_ext_factor", 1.0))
    if extrapolation != 1.0:
        raise ValueError(
            f"GGUF YaRN extrapolation factor {extrapolation} (rope.scaling.yarn_ext_factor) is "
            "not supported; supported: 1"
        )
    rope_scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": float(get("rope.scaling.factor")),
        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
        "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
    }
    attention_factor = get("rope.scaling.yarn_attn_factor", 0.0)
    if attention_factor:
        rope_scaling["attention_factor"] = float(attention_factor)
    return rope_scaling


def _moe_routing(config: dict[str, Any], get: ConfigGetter, family: str) -> None:
    """GLM-4.5's and DeepSeek-V3's routing: sigmoid scores chosen within groups, optionally
    renormalised and scaled, with ``n_shared_experts`` and dense ``first_k_dense_replace``
    layers first."""
    gating = int(get("expert_gating_func", 0))
    if gating != EXPERT_GATING_SIGMOID:
        # NOTE: llama.cpp reads a missing expert_gating_func as softmax (DeepSeek-V2's).
        raise ValueError(
            f"a {family} GGUF file with expert_gating_func {gating or 'absent'} (softmax "
            "routing, as DeepSeek-V2's) is not supported; supported: 2 (sigmoid, as "
            "DeepSeek-V3's and GLM-4.5's)"
        )
    config["n_routed_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    config["n_shared_experts"] = int(get("expert_shared_count", 0))
    config["first_k_dense_replace"] = int(get("leading_dense_block_count", 0))
    config["n_group"] = int(get("expert_group_count", 1))
    config["topk_group"] = int(get("expert_group_used_count", 1))
    config["routed_scaling_factor"] = float(get("expert_weights_scale", 1.0))
    # NOTE: as llama.cpp, which leaves the top-k weights unnormalised unless the file says so.
    config["norm_topk_prob"] = bool(get("expert_weights_norm", False))


def _mixtral_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    config["num_local_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))


def _qwen2_moe_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    config["num_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))
    # NOTE: the converter writes no expert_weights_norm for Qwen2-MoE; llama.cpp then leaves
    # the top-k routing weights as the softmax gives them.
    config["norm_topk_prob"] = bool(get("expert_weights_norm", False))
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = []


def _qwen3_moe_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    config["num_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    # NOTE: llama.cpp always renormalizes Qwen3-MoE's top-k routing weights.
    config["norm_topk_prob"] = bool(get("expert_weights_norm", True))
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = []


def _gemma3_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
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


def _olmo2_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    # NOTE: llama.cpp's converter writes OLMo 3 as an olmo2 file with sliding-window layers.
    if get("attention.sliding_window", 0):
        raise ValueError(
            "an olmo2 GGUF file with a sliding window (OLMo 3) is not supported; "
            "OLMo 2 is (no attention.sliding_window)"
        )


def _smollm3_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    interval = SMOLLM3_NO_ROPE_LAYER_INTERVAL
    config["no_rope_layer_interval"] = interval
    config["no_rope_layers"] = [
        int((layer + 1) % interval != 0) for layer in range(config["num_hidden_layers"])
    ]


def _phi3_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    del config["head_dim"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        config["partial_rotary_factor"] = rotary_dim / head_dim
    config["sliding_window"] = get("attention.sliding_window", 0) or None
    config["original_max_position_embeddings"] = int(
        get("rope.scaling.original_context_length", config["max_position_embeddings"])
    )


def _ernie4_5_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    # NOTE: ERNIE 4.5 has one switch for the biases of every projection.
    config["use_bias"] = config.pop("attention_bias")


def _ernie4_5_moe_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    _ernie4_5_config(config, get, tensors)
    config["moe_num_experts"] = int(get("expert_count"))
    config["moe_k"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    config["moe_num_shared_experts"] = int(get("expert_shared_count", 0))
    config["moe_layer_start_index"] = int(get("leading_dense_block_count", 0))
    config["moe_layer_interval"] = int(get("interleave_moe_layer_step", 1))
    # NOTE: llama.cpp runs experts from the first sparse layer to the last layer.
    config["moe_layer_end_index"] = -1


def _glm4_moe_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    _moe_routing(config, get, "glm4moe")
    # NOTE: the converter counts the multi-token-prediction layers in block_count.
    num_mtp_layers = int(get("nextn_predict_layers", 0))
    config["num_hidden_layers"] -= num_mtp_layers
    config["num_nextn_predict_layers"] = num_mtp_layers
    config["partial_rotary_factor"] = int(get("rope.dimension_count")) / config["head_dim"]
    config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors


def _gpt_oss_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    config["num_local_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["intermediate_size"] = int(get("expert_feed_forward_length"))
    config["sliding_window"] = int(get("attention.sliding_window"))
    pattern = GPT_OSS_SLIDING_WINDOW_PATTERN
    config["layer_types"] = [
        "sliding_attention" if (layer + 1) % pattern else "full_attention"
        for layer in range(config["num_hidden_layers"])
    ]
    config["swiglu_alpha"] = GPT_OSS_SWIGLU_ALPHA
    config["swiglu_limit"] = GPT_OSS_SWIGLU_LIMIT
    if "rope_scaling" in config:
        # NOTE: every gpt-oss checkpoint leaves YaRN's band bounds unrounded (truncate: false);
        # the file has no key for it.
        config["rope_scaling"]["truncate"] = False


def _deepseek2_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    """DeepSeek-V3's MLA from llama.cpp's keys. The converter writes MLA as multi-query
    attention over the latent (one KV head, keys of ``kv_lora_rank + qk_rope_head_dim``);
    ``key_length_mla`` and ``value_length_mla`` give the per-head sizes (older files, with
    ``attn_kv_b`` whole, give them as ``key_length`` and ``value_length``)."""
    _moe_routing(config, get, "deepseek2")
    num_mtp_layers = int(get("nextn_predict_layers", 0))
    config["num_hidden_layers"] -= num_mtp_layers
    config["num_nextn_predict_layers"] = num_mtp_layers
    config["num_key_value_heads"] = config["num_attention_heads"]
    config["intermediate_size"] = int(get("feed_forward_length"))
    q_lora_rank = get("attention.q_lora_rank", 0)
    config["q_lora_rank"] = int(q_lora_rank) if q_lora_rank else None
    config["kv_lora_rank"] = int(get("attention.kv_lora_rank"))
    rope_dims = int(get("rope.dimension_count"))
    key_length = int(get("attention.key_length_mla", 0))
    value_length = int(get("attention.value_length_mla", 0))
    if not key_length:
        key_length = int(get("attention.key_length"))
        value_length = int(get("attention.value_length"))
    config["qk_rope_head_dim"] = rope_dims
    config["qk_nope_head_dim"] = key_length - rope_dims
    config["qk_head_dim"] = key_length
    config["v_head_dim"] = value_length
    config["head_dim"] = rope_dims
    config["rope_interleave"] = True
    config["scoring_func"] = "sigmoid"
    config["topk_method"] = "noaux_tc"
    log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0))
    if "rope_scaling" in config and log_mul:
        mscale = round(log_mul / DEEPSEEK2_YARN_LOG_MUL_PER_MSCALE, 6)
        # NOTE: llama.cpp has one mscale for both: the cos/sin factor is 1.
        config["rope_scaling"] |= {"mscale": mscale, "mscale_all_dim": mscale}


_FAMILY_CONFIGS: dict[str, FamilyConfig] = {
    "mixtral": _mixtral_config,
    "qwen2_moe": _qwen2_moe_config,
    "qwen3_moe": _qwen3_moe_config,
    "gemma3_text": _gemma3_config,
    "phi3": _phi3_config,
    "olmo2": _olmo2_config,
    "smollm3": _smollm3_config,
    "ernie4_5": _ernie4_5_config,
    "ernie4_5_moe": _ernie4_5_moe_config,
    "glm4_moe": _glm4_moe_config,
    "gpt_oss": _gpt_oss_config,
    "deepseek_v3": _deepseek2_config,
}
