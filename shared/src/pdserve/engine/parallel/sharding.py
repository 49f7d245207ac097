"""Cuts a checkpoint tensor down to one rank's share as it is loaded.

Names are Hugging Face's (after Mixtral's are renamed), weights ``[out, in]``:

* column-parallel (split along ``out``): q/k/v and gate/up projections and their biases, of
  dense MLPs, shared experts and every routed expert (gpt-oss's stacked gate/up bias too);
  k/v over `RankShard.num_kv_parts` parts (replicated beyond the number of KV heads); the
  attention sinks with their query heads;
* latent attention by query heads (`attention_head_range`): ``q_proj`` or ``q_b_proj`` and
  ``kv_b_proj`` along ``out``, ``o_proj`` along ``in``; ``q_a_proj``, ``kv_a_proj_with_mqa``
  and the latent norms are replicated (every rank computes the whole latent);
* row-parallel (split along ``in``): o and down projections (their biases stay whole);
* vocabulary-parallel: the embedding and the LM head by rows, the last rank's padded with
  zeros to an equal share;
* fused in the checkpoint (Phi-3's qkv and gate/up, stacked experts): each part cut alike;
* anything else (norms, routers, the shared expert's gate) is replicated.
"""

from __future__ import annotations

import re

import torch

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import RankShard
from pdserve.engine.parallel.layers import attention_head_range

_PROJECTION = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|qkv_proj|gate_up_proj)"
    r"\.(weight|bias)$"
)
_STACKED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj|gate_up_proj_bias)$")
_MLA_PROJECTION = re.compile(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj|o_proj)\.weight$")
_SINKS = re.compile(r"\.self_attn\.sinks$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _rows(tensor: torch.Tensor, dim: int, span: range, unit: int = 1) -> torch.Tensor:
    """The slice `span` (in units of `unit` rows, e.g. a head's ``head_dim``) along `dim`."""
    return tensor.narrow(dim, span.start * unit, len(span) * unit)


def shard_tensor(
    name: str, tensor: torch.Tensor, config: ModelConfig, shard: RankShard
) -> torch.Tensor:
    """The share of checkpoint tensor `name` that rank `shard.rank` holds.

    Args:
        name: The tensor's Hugging Face name.
        tensor: The whole tensor, ``[out, in]`` for a projection's weight.
        config: The model.
        shard: The rank and the group's size.

    Returns:
        A view of `tensor` (or a padded copy for the vocabulary), the tensor itself for a
        group of one or a replicated tensor.
    """
    if shard.world_size == 1:
        return tensor
    if name in _VOCAB:
        rows = shard.vocab_range(config.vocab_size)
        local = tensor[rows.start : rows.stop]
        padding = shard.vocab_per_rank(config.vocab_size) - local.shape[0]
        return torch.nn.functional.pad(local, (0, 0, 0, padding)) if padding else local
    stacked = _STACKED_EXPERTS.search(name)
    if stacked is not None and config.moe is not None:
        # gate_up: [experts, 2 * intermediate, hidden]; down: [experts, hidden, intermediate]
        # gate_up_proj_bias: [experts, 2 * intermediate]
        span = shard.span(config.moe.moe_intermediate_size)
        if stacked.group(1) == "down_proj":
            return _rows(tensor, 2, span)
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat((_rows(gate, 1, span), _rows(up, 1, span)), dim=1)
    if config.mla is not None and (mla_match := _MLA_PROJECTION.search(name)) is not None:
        return _latent_attention_share(mla_match.group(1), tensor, config, shard)
    if _SINKS.search(name) is not None:
        return _rows(tensor, 0, attention_head_range(config, shard))
    match = _PROJECTION.search(name)
    if match is None:
        return tensor
    projection, kind = match.groups()
    head_dim = config.head_dim
    q_heads = shard.q_head_range(config.num_attention_heads, config.num_key_value_heads)
    kv_heads = shard.kv_head_range(config.num_key_value_heads)
    if projection == "o_proj":
        return _rows(tensor, 1, q_heads, head_dim) if kind == "weight" else tensor
    if projection in ("q_proj", "k_proj", "v_proj"):
        return _rows(tensor, 0, q_heads if projection == "q_proj" else kv_heads, head_dim)
    if projection == "qkv_proj":
        kv_size = config.num_key_value_heads * head_dim
        q, k, v = tensor.split([config.num_attention_heads * head_dim, kv_size, kv_size])
        parts = (
            _rows(q, 0, q_heads, head_dim),
            _rows(k, 0, kv_heads, head_dim),
            _rows(v, 0, kv_heads, head_dim),
        )
        return torch.cat(parts)
    # gate/up/down of a dense MLP, a shared expert or one routed expert: over its width
    if projection == "down_proj" and kind == "bias":
        return tensor  # NOTE: added once, after the sum over the ranks (ERNIE's use_bias)
    width = tensor.shape[1 if projection == "down_proj" else 0]
    if projection == "gate_up_proj":
        gate, up = tensor.chunk(2, dim=0)
        span = shard.span(width // 2)
        return torch.cat((_rows(gate, 0, span), _rows(up, 0, span)))
    span = shard.span(width)
    if projection == "down_proj":
        return _rows(tensor, 1, span)
    return _rows(tensor, 0, span)


def _latent_attention_share(
    projection: str, tensor: torch.Tensor, config: ModelConfig, shard: RankShard
) -> torch.Tensor:
    """A latent-attention projection's rows (``o_proj``: columns) of the rank's query heads."""
    mla = config.mla
    assert mla is not None
    heads = attention_head_range(config, shard)
    if projection == "o_proj":
        return _rows(tensor, 1, heads, mla.v_head_dim)
    if projection == "kv_b_proj":
        # [heads * (nope + v), kv_lora_rank]: each head's W_UK rows, then its W_UV rows
        return _rows(tensor, 0, heads, mla.qk_nope_head_dim + mla.v_head_dim)
    # q_proj or q_b_proj: [heads * (nope + rope), in]
    return _rows(tensor, 0, heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim)
