"""The Hugging Face ``config.json`` a GGUF file's ``{arch}.*`` metadata describes: the keys
every family has, then the family's own (`pdserve.engine.families`; `gguf_architectures`
holds the tensor side)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pdserve.engine.families import ConfigGetter, gguf_family
from pdserve.engine.gguf_rope import llama3_rope_scaling

# llama.cpp's expert gating functions (``{arch}.expert_gating_func``).
EXPERT_GATING_SOFTMAX, EXPERT_GATING_SIGMOID = 1, 2


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
    family = gguf_family(metadata)
    assert family.gguf is not None
    rules = family.gguf.tensors
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
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = _rope_scaling(str(scaling), get)
    if "rope_freqs.weight" in tensor_names:
        if not family.gguf.reads_rope_freqs or rope_freqs is None or "rope_scaling" in config:
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
    if family.gguf.config is not None:
        family.gguf.config(config, get, tensor_names)
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


def qwen_moe_routing(config: dict[str, Any], get: ConfigGetter, renormalise: bool) -> None:
    """Qwen2-MoE's and Qwen3-MoE's experts: on every layer, the top-k of a softmax,
    renormalised when the file says so (`renormalise` when it says nothing, as llama.cpp)."""
    config["num_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    config["norm_topk_prob"] = bool(get("expert_weights_norm", renormalise))
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = []


def sigmoid_group_routing(config: dict[str, Any], get: ConfigGetter, family: str) -> None:
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
