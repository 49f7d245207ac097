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
  ``qwen2moe``: Qwen2's attention, routed experts and a gated shared expert.
* ``gemma3``: the text model (``gemma3_text``); llama.cpp stores every norm weight plus one,
  which is subtracted again; sliding-window layers every 6th layer global.
* ``phi3``: fused ``qkv_proj`` and ``gate_up_proj``.
* ``olmo2``: norms after each block, q/k norms across all heads; no permutation.
* ``smollm3``: Llama's tensors, q/k rows permuted; RoPE left out of every fourth layer.
* ``ernie4_5``: Llama's tensors (a bias on each where ``use_bias``), not permuted: ERNIE's RoPE
  rotates adjacent pairs, as llama.cpp's does. ``ernie4_5-moe``: leading dense layers, then
  routed experts with a score correction (``exp_probs_b``) and ungated shared experts.
* ``glm4moe``: q/k/v biases and q/k norms, leading dense layers, routed experts with a score
  correction and shared experts; the multi-token-prediction layers the converter appends
  (``nextn_predict_layers``) are left out, as transformers leaves them.
* ``gpt-oss``: attention sinks (``attn_sinks``), a router with a bias, experts with biases;
  llama.cpp's separate gate and up experts are interleaved again into transformers'
  ``gate_up_proj`` (``[experts, in, 2 * size]``), the down experts transposed back.
* ``deepseek2``: DeepSeek-V3's multi-head latent attention and experts; ``kv_b_proj`` is stored
  split for llama.cpp's absorbed attention (``attn_k_b``, transposed, and ``attn_v_b``) and is
  joined again (older files store ``attn_kv_b`` whole).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = (
    "llama", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma3", "phi3", "olmo2", "smollm3",
    "ernie4_5", "ernie4_5-moe", "glm4moe", "gpt-oss", "deepseek2",
)  # fmt: skip

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
_SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_DENSE_FFN_NAMES = {k: v for k, v in _DENSE_LAYER_NAMES.items() if k.startswith("ffn_")}
_SHARED_EXPERTS_NAMES = {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# NOTE: tensors that hold settings, not weights: `gguf_config` reads them into the config.
CONFIG_TENSORS = ("rope_freqs.weight",)
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(\d+))?\.(weight|bias)$")
_LAYER_INDEX = re.compile(r"^blk\.(\d+)\.")
PIECE = "#"
"""Separates a Hugging Face name from the piece of it one GGUF tensor holds (`hf_tensors`)."""

Joiner = Callable[[str, Mapping[str, np.ndarray]], np.ndarray]
"""Builds one Hugging Face tensor (named by its suffix) from its pieces, by piece name."""


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
        exact_names: llama.cpp layer tensor with its kind (``attn_sinks.weight``) ->
            Hugging Face name after the layer prefix, for tensors whose Hugging Face name ends
            otherwise (``self_attn.sinks``).
        pieces: llama.cpp layer tensor with its kind -> (Hugging Face name after the layer
            prefix, piece): tensors that llama.cpp split or reshaped, rebuilt by `join`
            once every piece of the name has been read.
        join: Rebuilds a tensor of `pieces`.
        has_mtp_layers: Whether layers past ``num_hidden_layers`` (multi-token prediction,
            which the engine does not run) are left out rather than refused.
    """

    model_type: str
    hf_class: str
    layer_names: Mapping[str, str]
    expert_names: Mapping[str, str] = field(default_factory=dict)
    is_qk_permuted: bool = False
    norm_offset: float = 0.0
    exact_names: Mapping[str, str] = field(default_factory=dict)
    pieces: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    join: Joiner | None = None
    has_mtp_layers: bool = False

    def piece_count(self, hf_suffix: str) -> int:
        """How many GGUF tensors hold pieces of the Hugging Face tensor `hf_suffix`."""
        return sum(1 for suffix, _ in self.pieces.values() if suffix == hf_suffix)


def _join_kv_b(hf_suffix: str, pieces: Mapping[str, np.ndarray]) -> np.ndarray:
    """DeepSeek's ``kv_b_proj`` (``[heads * (nope + v), kv_lora_rank]``) from llama.cpp's
    ``attn_k_b`` (``[heads, kv_lora_rank, nope]``) and ``attn_v_b`` (``[heads, v,
    kv_lora_rank]``)."""
    k_b, v_b = pieces["k_b"], pieces["v_b"]
    joined = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1)
    return np.ascontiguousarray(joined.reshape(-1, joined.shape[-1]))


def _join_gpt_oss_experts(hf_suffix: str, pieces: Mapping[str, np.ndarray]) -> np.ndarray:
    """gpt-oss's stacked experts as transformers stores them: gate and up interleaved, column
    by column, in ``gate_up_proj`` (``[experts, in, 2 * size]``) and its bias; ``down_proj``
    as ``[experts, in, out]``. llama.cpp stores ``[experts, out, in]`` matrices."""
    if hf_suffix.endswith("down_proj"):
        return np.ascontiguousarray(pieces["down"].transpose(0, 2, 1))
    gate, up = pieces["gate"], pieces["up"]
    if hf_suffix.endswith("_bias"):
        # gate, up: [experts, size]
        return np.stack((gate, up), axis=-1).reshape(gate.shape[0], -1)
    # gate, up: [experts, size, in]
    interleaved = np.stack((gate, up), axis=2).reshape(gate.shape[0], -1, gate.shape[-1])
    return np.ascontiguousarray(interleaved.transpose(0, 2, 1))


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
    "qwen2moe": ArchitectureRules(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        _ATTENTION_NAMES
        | _SHARED_EXPERT_NAMES
        | {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"},
        _QWEN3_MOE_EXPERTS,
    ),
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
    "olmo2": ArchitectureRules(
        "olmo2",
        "Olmo2ForCausalLM",
        _ATTENTION_NAMES
        | _QK_NORM_NAMES
        | {
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
        },
    ),
    "smollm3": ArchitectureRules(
        "smollm3", "SmolLM3ForCausalLM", _DENSE_LAYER_NAMES, is_qk_permuted=True
    ),
    "phi3": ArchitectureRules(
        "phi3",
        "Phi3ForCausalLM",
        _DENSE_LAYER_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    ),
    "ernie4_5": ArchitectureRules("ernie4_5", "Ernie4_5ForCausalLM", _DENSE_LAYER_NAMES),
    "ernie4_5-moe": ArchitectureRules(
        "ernie4_5_moe",
        "Ernie4_5_MoeForCausalLM",
        _DENSE_LAYER_NAMES | _SHARED_EXPERTS_NAMES | {"ffn_gate_inp": "mlp.gate"},
        _QWEN3_MOE_EXPERTS,
        exact_names={"exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias"},
    ),
    "glm4moe": ArchitectureRules(
        "glm4_moe",
        "Glm4MoeForCausalLM",
        _ATTENTION_NAMES
        | _QK_NORM_NAMES
        | _DENSE_FFN_NAMES
        | _SHARED_EXPERTS_NAMES
        | {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"},
        _QWEN3_MOE_EXPERTS,
        exact_names={"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
        has_mtp_layers=True,
    ),
    "gpt-oss": ArchitectureRules(
        "gpt_oss",
        "GptOssForCausalLM",
        _ATTENTION_NAMES
        | {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"},
        exact_names={
            "attn_sinks.weight": "self_attn.sinks",
            "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
        },
        pieces={
            "ffn_gate_exps.weight": ("mlp.experts.gate_up_proj", "gate"),
            "ffn_up_exps.weight": ("mlp.experts.gate_up_proj", "up"),
            "ffn_gate_exps.bias": ("mlp.experts.gate_up_proj_bias", "gate"),
            "ffn_up_exps.bias": ("mlp.experts.gate_up_proj_bias", "up"),
            "ffn_down_exps.weight": ("mlp.experts.down_proj", "down"),
        },
        join=_join_gpt_oss_experts,
    ),
    "deepseek2": ArchitectureRules(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        {
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj",
            "attn_q_a": "self_attn.q_a_proj",
            "attn_q_a_norm": "self_attn.q_a_layernorm",
            "attn_q_b": "self_attn.q_b_proj",
            "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
            "attn_kv_a_norm": "self_attn.kv_a_layernorm",
            "attn_kv_b": "self_attn.kv_b_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_gate_inp": "mlp.gate",
        }
        | _DENSE_FFN_NAMES
        | _SHARED_EXPERTS_NAMES,
        _QWEN3_MOE_EXPERTS,
        exact_names={"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
        pieces={
            "attn_k_b.weight": ("self_attn.kv_b_proj.weight", "k_b"),
            "attn_v_b.weight": ("self_attn.kv_b_proj.weight", "v_b"),
        },
        join=_join_kv_b,
        has_mtp_layers=True,
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

    A 3-D expert tensor yields one matrix per expert; a tensor that holds a setting
    (`CONFIG_TENSORS`) or belongs to a multi-token-prediction layer yields nothing; a piece
    of a tensor llama.cpp split (`ArchitectureRules.pieces`) yields itself under the Hugging
    Face name, `PIECE` and the piece's name, for `hf_checkpoint` to join; every other tensor
    yields itself, renamed, with llama.cpp's changes undone.

    Raises:
        ValueError: For a tensor the architecture does not have.
    """
    if gguf_name in CONFIG_TENSORS:
        return
    layer_match = _LAYER_INDEX.match(gguf_name)
    layer_index = int(layer_match[1]) if layer_match else -1
    if rules.has_mtp_layers and layer_index >= int(config["num_hidden_layers"]):
        return
    if gguf_name in _GLOBAL_NAMES:
        yield _GLOBAL_NAMES[gguf_name], _undo_norm_offset(gguf_name, values, rules)
        return
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None:
        raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file")
    layer, part, expert, kind = match.groups()
    prefix = f"model.layers.{layer}"
    if expert is None and f"{part}.{kind}" in rules.exact_names:
        yield f"{prefix}.{rules.exact_names[f'{part}.{kind}']}", values
        return
    if expert is None and f"{part}.{kind}" in rules.pieces:
        suffix, piece = rules.pieces[f"{part}.{kind}"]
        yield f"{prefix}.{suffix}{PIECE}{piece}", values
        return
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


def hf_checkpoint(
    tensors: Iterable[tuple[str, np.ndarray]], rules: ArchitectureRules, config: Mapping[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """`hf_tensors` over (GGUF name, dequantized array) pairs, with split tensors joined.

    Raises:
        ValueError: For a tensor the architecture does not have, or a split tensor whose
            pieces the file does not all hold.
    """
    pending: dict[str, dict[str, np.ndarray]] = {}
    for gguf_name, values in tensors:
        for name, array in hf_tensors(gguf_name, values, rules, config):
            hf_name, is_piece, piece = name.partition(PIECE)
            if not is_piece:
                yield name, array
                continue
            pieces = pending.setdefault(hf_name, {})
            pieces[piece] = array
            suffix = hf_name.split(".", 3)[3]
            if len(pieces) == rules.piece_count(suffix):
                assert rules.join is not None
                yield hf_name, rules.join(suffix, pending.pop(hf_name))
    if pending:
        raise ValueError(f"the GGUF file holds only part of {', '.join(sorted(pending))}")


def _undo_norm_offset(name: str, values: np.ndarray, rules: ArchitectureRules) -> np.ndarray:
    if rules.norm_offset and "norm" in name:
        return values - np.float32(rules.norm_offset)
    return values
