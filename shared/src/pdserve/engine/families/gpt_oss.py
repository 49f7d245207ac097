"""gpt-oss (gpt-oss-20b, gpt-oss-120b: as released, the experts in MXFP4, which the loader keeps
as int8 groups of the values they hold on a CPU (`pdserve.engine.moe.KeptExperts`) or reads as
those values in the model's dtype (`pdserve.engine.packed_weights`), or a bfloat16 copy).

Attention sinks, sliding and full layers alternating by ``layer_types``, YaRN RoPE, a bias on
every attention projection; every layer MoE: the router (with a bias) picks the top-k logits
and softmaxes over them alone, experts with biases and the clamped SwiGLU (gate and up
interleaved in the checkpoint, reordered at load); RMSNorm scaled in float32.

GGUF: ``gpt-oss`` files; llama.cpp's separate gate and up experts are interleaved again into
``gate_up_proj`` and the down experts transposed back (MXFP4 experts stay MXFP4, repacked as
the released checkpoints hold them); the SwiGLU limit and alpha, the layer
pattern (sliding first) and YaRN's ``truncate: false`` are llama.cpp's, as the file does not
say them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from pdserve.engine.arch_config import MoeConfig
from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import ATTENTION_NAMES, ArchitectureRules

# NOTE: llama.cpp hardcodes gpt-oss's clamped SwiGLU (alpha, limit) and its layer pattern
# (sliding-window layers first, then alternating with full ones).
GPT_OSS_SWIGLU_ALPHA = 1.702
GPT_OSS_SWIGLU_LIMIT = 7.0
GPT_OSS_SLIDING_WINDOW_PATTERN = 2


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    fields["has_attention_sinks"] = True
    fields["is_norm_scaled_in_float32"] = True
    fields["moe"] = MoeConfig(
        num_experts=int(hf.get("num_local_experts", 32)),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 4)),
        moe_intermediate_size=int(hf["intermediate_size"]),
        norm_topk_prob=False,
        moe_layers=(True,) * fields["num_hidden_layers"],
        scoring="top_logits",
        router_bias=True,
        expert_bias=True,
        clamped_swiglu=(
            float(hf.get("swiglu_alpha", 1.702)),
            float(hf.get("swiglu_limit", 7.0)),
        ),
    )


def _load_tensor(name: str, tensor: torch.Tensor, config: Any) -> torch.Tensor:
    """gpt-oss's stacked experts as the other families store them: gate and up, interleaved
    column by column in ``gate_up_proj`` (``[experts, in, 2 * size]``) and its bias, become
    the gate's half then the up's; the ``[experts, in, out]`` projections become ``[experts,
    out, in]``, how transformers' other families write stacked experts."""
    if name.endswith(".experts.gate_up_proj_bias"):
        return torch.cat((tensor[..., ::2], tensor[..., 1::2]), dim=-1)
    if name.endswith(".experts.gate_up_proj"):
        tensor = torch.cat((tensor[..., ::2], tensor[..., 1::2]), dim=-1)
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return tensor.transpose(1, 2)
    return tensor


def _join_experts(hf_suffix: str, pieces: Mapping[str, np.ndarray]) -> np.ndarray:
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


def _join_mxfp4_experts(hf_suffix: str, pieces: Mapping[str, np.ndarray]) -> np.ndarray:
    """gpt-oss's MXFP4 experts as the released checkpoints pack them: ``gate_up_proj``'s
    blocks (or scales) with gate and up interleaved row by row (``[experts, 2 * size, ...]``);
    ``down_proj``'s as llama.cpp stores them (rows are outputs in both)."""
    if hf_suffix.endswith("down_proj"):
        return pieces["down"]
    gate, up = pieces["gate"], pieces["up"]
    return np.stack((gate, up), axis=2).reshape(gate.shape[0], -1, *gate.shape[2:])


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
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


FAMILY = Family(
    "gpt_oss",
    config=_config,
    renames=((re.compile(r"\.mlp\.router\."), ".mlp.gate."),),
    load_tensor=_load_tensor,
    gguf=GgufFamily(
        "gpt-oss",
        ArchitectureRules(
            "gpt_oss",
            "GptOssForCausalLM",
            ATTENTION_NAMES
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
            join=_join_experts,
            join_mxfp4=_join_mxfp4_experts,
        ),
        config=_gguf_config,
    ),
)
