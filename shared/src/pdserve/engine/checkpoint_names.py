"""How a Hugging Face checkpoint's tensor names map onto the engine's parameters: the
projections it stacks (q/k/v, gate/up), routed experts, the renames several families share
(each family's own are in its module, `pdserve.engine.families`), and RoPE's adjacent pairs
reordered into halves."""

from __future__ import annotations

import re
from typing import Any

import torch

from pdserve.engine.arch_config import MlaConfig
from pdserve.engine.families import families

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
# The shared experts as ERNIE 4.5, GLM-4.5 and DeepSeek name them (one MLP, as Qwen2-MoE's).
SHARED_EXPERTS = (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert.")
# The router's score correction as GLM-4.5 and DeepSeek-V3 name it.
GATE_SCORE_CORRECTION = (
    re.compile(r"\.mlp\.gate\.e_score_correction_bias$"),
    ".mlp.score_correction",
)
# One routed expert's projection, stacked into the layer's 3-D expert tensors.
EXPERT_NAME = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# transformers >= 5 may also write the experts already stacked: [experts, out, in].
STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def renamed(hf_name: str) -> str:
    """The name the engine loads `hf_name` under, whichever family's checkpoint it comes from
    (every family's renames; the loader applies the model's family's alone)."""
    for family in families().values():
        hf_name = family.renamed(hf_name)
    return hf_name


def layer_index(hf_name: str) -> int:
    """The decoder layer a tensor belongs to (``model.layers.{i}.``), -1 for none."""
    match = LAYER_NAME.match(hf_name)
    return -1 if match is None else int(match.group(1))


def without_trailing_layers(name: str, tensor: Any, config: Any) -> Any:
    """A family's `load_tensor` that leaves out the layers after the config's last: the
    multi-token-prediction layers DeepSeek-V3 and GLM-4.5 keep there, which are not served."""
    return None if layer_index(name) >= config.num_hidden_layers else tensor


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
