"""What each GGUF architecture becomes in Hugging Face terms: ``config.json`` and tensor names.

llama.cpp names an architecture (``general.architecture``) and its tensors its own way, and
changes some values on the way in. For every architecture pdserve reads, this module holds the
Hugging Face ``model_type``, the config keys built from the ``{arch}.*`` metadata, the tensor
renaming, and the undoing of llama.cpp's changes, so that the directory equals the one
transformers' ``save_pretrained`` writes for the same model:

* ``llama``: Llama, Mistral; with ``llama.expert_count`` > 0 it is Mixtral. The q/k rows are
  permuted back (llama.cpp interleaves the rotary halves).
* ``qwen2``: q/k/v biases. ``qwen3``: q/k RMS norms. ``qwen3moe``: Qwen3's attention with
  routed experts, stored as one 3-D tensor per projection and split into one matrix per expert.
* ``gemma3``: the text model (``gemma3_text``); llama.cpp stores every norm weight plus one,
  which is subtracted again; sliding-window layers every 6th layer global.
* ``phi3``: fused ``qkv_proj`` and ``gate_up_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3")
# NOTE: llama.cpp hardcodes Gemma 3's layer pattern (five sliding-window layers, then a global
# one) and the sliding layers' RoPE base; newer files may state them, older ones do not.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_NUM_LAYERS = 62

ConfigGetter = Callable[..., Any]
"""Reads ``{arch}.<key>`` from the metadata: ``get(key, default=None)``; raises if absent."""

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_DENSE_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_ATTENTION_NAMES = {k: v for k, v in _DENSE_LAYER_NAMES.items() if not k.startswith("ffn_")}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")


@dataclass(frozen=True)
class ArchitectureRules:
    """How one architecture's GGUF tensors become Hugging Face tensors.

    Attributes:
        model_type: The Hugging Face ``model_type``.
        hf_class: The ``architectures`` entry of ``config.json``.
        layer_names: llama.cpp layer tensor part (``attn_q``) -> Hugging Face part
            (``self_attn.q_proj``).
        expert_names: llama.cpp expert tensor part (``ffn_gate_exps``, or ``ffn_gate`` for
            Mixtral files that store one tensor per expert) -> Hugging Face part with an
            ``{expert}`` field.
        is_qk_permuted: Whether llama.cpp permuted the q/k rows (Llama, Mixtral).
        norm_offset: What llama.cpp added to every norm weight (Gemma: 1).
    """

    model_type: str
    hf_class: str
    layer_names: Mapping[str, str]
    expert_names: Mapping[str, str] = field(default_factory=dict)
    is_qk_permuted: bool = False
    norm_offset: float = 0.0


_QWEN3_MOE_EXPERTS = {
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
}
_MIXTRAL_EXPERTS = {
    "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
    "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
    "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3",
    # NOTE: Mixtral files from before 2024 store one 2-D tensor per expert (blk.N.ffn_gate.E).
    "ffn_gate": "block_sparse_moe.experts.{expert}.w1",
    "ffn_down": "block_sparse_moe.experts.{expert}.w2",
    "ffn_up": "block_sparse_moe.experts.{expert}.w3",
}
RULES = {
    "llama": ArchitectureRules(
        "llama", "LlamaForCausalLM", _DENSE_LAYER_NAMES, is_qk_permuted=True
    ),
    "mixtral": ArchitectureRules(
        "mixtral",
        "MixtralForCausalLM",
        _ATTENTION_NAMES
        | {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "block_sparse_moe.gate"},
        _MIXTRAL_EXPERTS,
        is_qk_permuted=True,
    ),
    "qwen2": ArchitectureRules("qwen2", "Qwen2ForCausalLM", _DENSE_LAYER_NAMES),
    "qwen3": ArchitectureRules("qwen3", "Qwen3ForCausalLM", _DENSE_LAYER_NAMES | _QK_NORM_NAMES),
    "qwen3moe": ArchitectureRules(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        _ATTENTION_NAMES
        | _QK_NORM_NAMES
        | {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"},
        _QWEN3_MOE_EXPERTS,
    ),
    "gemma3": ArchitectureRules(
        "gemma3_text",
        "Gemma3ForCausalLM",
        _DENSE_LAYER_NAMES
        | _QK_NORM_NAMES
        | {
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        norm_offset=1.0,
    ),
    "phi3": ArchitectureRules(
        "phi3",
        "Phi3ForCausalLM",
        _DENSE_LAYER_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    ),
}


def architecture_rules(metadata: Mapping[str, Any]) -> ArchitectureRules:
    """The rules for the file's architecture (Mixtral for a ``llama`` file with experts).

    Raises:
        ValueError: For an architecture pdserve does not read, naming it and the supported ones.
    """
    arch = str(metadata.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (general.architecture); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (llama with experts is Mixtral)"
        )
    if arch == "llama" and int(metadata.get("llama.expert_count") or 0) > 0:
        return RULES["mixtral"]
    return RULES[arch]


def hf_config(metadata: Mapping[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The Hugging Face ``config.json`` object the GGUF metadata describes.

    Raises:
        ValueError: For an architecture or setting pdserve does not implement.
    """
    rules = architecture_rules(metadata)
    arch = str(metadata["general.architecture"])
    refused = {
        "rope_freqs.weight": "GGUF per-frequency RoPE factors (rope_freqs) are not supported",
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
        "attention_bias": arch != "qwen2" and "blk.0.attn_q.bias" in tensor_names,
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
    "qwen3_moe": _qwen3_moe_config,
    "gemma3_text": _gemma3_config,
    "phi3": _phi3_config,
}


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's reordering of a Llama q/k projection's rows (weight or bias).

    llama.cpp interleaves the two rotary halves of each head (``[h, 2, d/2] -> [h, d/2, 2]``);
    the Hugging Face layout, which the engine uses, keeps them as halves.
    """
    # weight: [num_heads * head_dim, ...]
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def hf_tensors(
    gguf_name: str, values: np.ndarray, rules: ArchitectureRules, config: Mapping[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (Hugging Face name, array) for one dequantized llama.cpp tensor.

    A 3-D expert tensor yields one matrix per expert; every other tensor yields itself, renamed,
    with llama.cpp's changes undone.

    Raises:
        ValueError: For a tensor the architecture does not have.
    """
    if gguf_name in _GLOBAL_NAMES:
        yield _GLOBAL_NAMES[gguf_name], _undo_norm_offset(gguf_name, values, rules)
        return
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None:
        raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file")
    layer, part, expert, kind = match.groups()
    prefix = f"model.layers.{layer}"
    if part in rules.expert_names and (expert is not None or part.endswith("_exps")):
        pattern = f"{prefix}.{rules.expert_names[part]}.{kind}"
        if expert is not None:
            yield pattern.format(expert=expert), values
            return
        # values: [num_experts, rows, cols]
        for index, matrix in enumerate(values):
            yield pattern.format(expert=index), np.ascontiguousarray(matrix)
        return
    if expert is not None or part not in rules.layer_names:
        raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file for {rules.model_type}")
    if rules.is_qk_permuted and part in ("attn_q", "attn_k"):
        heads_key = "num_attention_heads" if part == "attn_q" else "num_key_value_heads"
        values = np.ascontiguousarray(unpermute_rows(values, int(config[heads_key])))
    yield f"{prefix}.{rules.layer_names[part]}.{kind}", _undo_norm_offset(part, values, rules)


def _undo_norm_offset(name: str, values: np.ndarray, rules: ArchitectureRules) -> np.ndarray:
    if rules.norm_offset and "norm" in name:
        return values - np.float32(rules.norm_offset)
    return values
