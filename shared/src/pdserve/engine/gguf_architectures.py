"""How a GGUF file's tensors become Hugging Face tensors: the machinery, and the names
llama.cpp's families share.

llama.cpp names an architecture (``general.architecture``) and its tensors its own way, and
changes some values on the way in. Each family's module (`pdserve.engine.families`) holds its
`ArchitectureRules`: the Hugging Face ``model_type`` and class, the tensor renaming (built
from the shared name maps here where it can), and what of llama.cpp's changes to undo
(permuted q/k rows, an offset on every norm weight, tensors split or reshaped), so that the
directory equals the one transformers' ``save_pretrained`` writes for the same model.
`hf_tensors` and `hf_checkpoint` apply a family's rules to the file's tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# NOTE: the llama.cpp -> Hugging Face names of a layer's parts that many families share.
DENSE_LAYER_NAMES = {
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
QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
ATTENTION_NAMES = {k: v for k, v in DENSE_LAYER_NAMES.items() if not k.startswith("ffn_")}
SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
DENSE_FFN_NAMES = {k: v for k, v in DENSE_LAYER_NAMES.items() if k.startswith("ffn_")}
SHARED_EXPERTS_NAMES = {
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
ROUTED_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
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
        join_mxfp4: Rebuilds a tensor of `pieces` held in MXFP4 in the released checkpoints'
            form (``[..., rows, cols / 32, 16]`` blocks, ``[..., rows, cols / 32]`` scales,
            each joined alone; `pdserve.engine.gguf_import.mxfp4_tensors`); None: MXFP4 pieces
            are dequantized like any other.
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
    join_mxfp4: Joiner | None = None
    has_mtp_layers: bool = False

    def piece_count(self, hf_suffix: str) -> int:
        """How many GGUF tensors hold pieces of the Hugging Face tensor `hf_suffix`."""
        return sum(1 for suffix, _ in self.pieces.values() if suffix == hf_suffix)


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
