"""How a Hugging Face checkpoint's tensor names map onto the engine's parameters: the
projections it stacks (q/k/v, gate/up), Mixtral's names, and routed experts."""

from __future__ import annotations

import re

import torch

from pdserve.engine.arch_config import MlaConfig

# NOTE: HF keeps q/k/v and gate/up as separate matrices; we stack them into one projection.
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# A decoder layer's tensors.
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
# q's and k's projections, split or (Phi-3) fused.
QK_NAME = re.compile(r"\.(q_proj|k_proj)\.(weight|bias)$")
SHARD_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
# Mixtral's names for the MoE block and its experts' projections.
MIXTRAL_NAMES = (
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
)
# ERNIE 4.5's and GLM-4.5's names for the shared experts and the router's score correction.
ERNIE_NAMES = (
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),
    (re.compile(r"\.mlp\.(gate\.)?moe_statics\.e_score_correction_bias$"), ".mlp.score_correction"),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.score_correction"),
)
# gpt-oss's router.
GPT_OSS_NAMES = ((re.compile(r"\.mlp\.router\."), ".mlp.gate."),)
# One routed expert's projection, stacked into the layer's 3-D expert tensors.
EXPERT_NAME = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# transformers >= 5 may also write the experts already stacked: [experts, out, in].
STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def renamed(hf_name: str) -> str:
    """The name the engine loads `hf_name` under (Mixtral's names as the other families')."""
    for pattern, replacement in (*MIXTRAL_NAMES, *ERNIE_NAMES, *GPT_OSS_NAMES):
        hf_name = pattern.sub(replacement, hf_name)
    return hf_name


def gpt_oss_experts(name: str, tensor: torch.Tensor) -> torch.Tensor:
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


def _evens_then_odds(num_dims: int) -> torch.Tensor:
    """``[0, 2, 4, ..., 1, 3, 5, ...]``: adjacent RoPE pairs moved to the two halves."""
    return torch.cat([torch.arange(0, num_dims, 2), torch.arange(1, num_dims, 2)])


def rope_pairs_to_halves(
    tensor: torch.Tensor, head_dim: int, rotary_dim: int | None = None
) -> torch.Tensor:
    """The rows of a q or k projection (weight ``[heads * head_dim, in]`` or bias) with each
    head's rotated dims reordered evens first, then odds.

    RoPE over adjacent pairs ``(2i, 2i + 1)`` (ERNIE 4.5) rotates ``x[2i]`` with ``x[2i + 1]``
    at frequency i; after this reordering they sit at ``i`` and ``i + rotary_dim / 2``, where
    the half-split rotation takes them with the same frequency: the same products, and q.k
    (both reordered alike) the same sum of terms.
    """
    rotary = rotary_dim or head_dim
    order = torch.cat([_evens_then_odds(rotary), torch.arange(rotary, head_dim)])
    heads = tensor.reshape(-1, head_dim, *tensor.shape[1:])
    return heads[:, order].reshape(tensor.shape)


def mla_rope_pairs_to_halves(name: str, tensor: torch.Tensor, mla: MlaConfig) -> torch.Tensor:
    """DeepSeek's rotated dims reordered evens first, then odds (`rope_pairs_to_halves`): the
    last ``qk_rope_head_dim`` rows of each head of ``q_proj`` / ``q_b_proj``, and of
    ``kv_a_proj_with_mqa`` (after the latent's ``kv_lora_rank``)."""
    rope = mla.qk_rope_head_dim
    order = _evens_then_odds(rope)
    if name.endswith((".q_proj.weight", ".q_b_proj.weight")):
        heads = tensor.reshape(-1, mla.qk_nope_head_dim + rope, *tensor.shape[1:])
        heads = torch.cat(
            (heads[:, : mla.qk_nope_head_dim], heads[:, mla.qk_nope_head_dim :][:, order]), 1
        )
        return heads.reshape(tensor.shape)
    if name.endswith((".kv_a_proj_with_mqa.weight", ".kv_a_proj_with_mqa.bias")):
        rows = torch.cat((torch.arange(mla.kv_lora_rank), mla.kv_lora_rank + order))
        return tensor[rows]
    return tensor
