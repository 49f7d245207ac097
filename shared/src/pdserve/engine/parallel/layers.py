"""The vocabulary-parallel embedding and the local sizes of a rank's share of the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import RankShard, TensorParallelGroup, check_divisible


def check_model_fits(config: ModelConfig, group: TensorParallelGroup) -> None:
    """Refuses a tensor-parallel size the model's heads cannot be split over (a ValueError that
    names the size). Intermediate sizes split into shares that differ by at most one.

    Latent attention (`ModelConfig.mla`) splits its query heads alone (its one latent is
    every rank's): any size up to the number of heads, in shares that differ by at most one.
    """
    size = group.world_size
    if size == 1:
        return
    if config.mla is not None:
        if size > config.num_attention_heads:
            raise ValueError(
                f"tensor_parallel_size {size} is more than the {config.num_attention_heads} "
                "query heads of latent attention (every rank needs one)"
            )
        return
    check_divisible(group.shard, config.num_attention_heads, config.num_key_value_heads)


def attention_head_range(config: ModelConfig, shard: RankShard) -> range:
    """The query heads rank `shard.rank` holds (their slices of q, the sinks and o).

    With latent attention an even share of all heads (`RankShard.span`): every head reads the
    same latent, so no GQA group has to stay whole. Otherwise `RankShard.q_head_range`.
    """
    if config.mla is not None:
        return shard.span(config.num_attention_heads)
    return shard.q_head_range(config.num_attention_heads, config.num_key_value_heads)


def cache_head_range(config: ModelConfig, shard: RankShard) -> range:
    """The heads of the cache's layout (`ModelConfig.cache_num_kv_heads`) rank `shard.rank`
    attends over: its KV heads (`RankShard.kv_head_range`), or with latent attention all of
    them, the whole latent (it is not split: every query head reads all of it)."""
    if config.mla is not None:
        return range(config.cache_num_kv_heads)
    return shard.kv_head_range(config.num_key_value_heads)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows are split over the ranks: each looks up the ids in its slice,
    zeroes the others, and the rows are summed over the ranks.

    Args:
        vocab_size: Rows of the whole embedding.
        hidden_size: Width of a row.
        group: The rank's group; its share is `RankShard.vocab_range`, padded with zero rows
            to `RankShard.vocab_per_rank`.
    """

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.group = group
        rows = group.shard.vocab_range(vocab_size)
        self.vocab_start, self.vocab_end = rows.start, rows.stop
        self.weight = nn.Parameter(torch.empty(group.shard.vocab_per_rank(vocab_size), hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden_size]
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_local, input_ids - self.vocab_start, 0)
        hidden = F.embedding(local_ids, self.weight)
        hidden = hidden * is_local.unsqueeze(-1).to(hidden.dtype)
        return self.group.all_reduce(hidden)
