"""Multi-head latent attention (DeepSeek-V3), computed on the latent the cache holds.

A token's K and V for every head come from one latent: ``c`` (``kv_lora_rank`` values, normed)
and ``k_pe`` (``qk_rope_head_dim`` values, rotated), which the cache stores instead of per-head
K and V: the first half of the latent in a block's K, the second in its V (one "KV head" each,
`ModelConfig.cache_head_dim`), so a block holds ``kv_lora_rank + qk_rope_head_dim`` values per
token and layer (576 for DeepSeek-V3, against 40,960 for its 128 heads of K and V), and that is
what transfers, the KV store and the prefix cache move.

Attention runs in the absorbed form: a head's key is ``W_UK c`` and its value ``W_UV c``, so
``q.k = (W_UK^T q_nope) . c + q_pe . k_pe``: the query is folded into the latent space once
per token, every head attends over the same latent keys (multi-query attention), and the
weighted sum of latents is turned into each head's value after. Each query token attends as
its own batch element over keys padded by its position (`InvariantAttention`): the same
arithmetic in a prefill and a decode, whatever the batch.

Under tensor parallelism a rank holds a share of the query heads (their rows of ``q_b_proj``
or ``q_proj`` and of ``kv_b_proj``, their columns of ``o_proj``, whose products are summed
over the ranks) and attends over the whole latent: ``kv_a_proj_with_mqa`` and the latent norm
are replicated, so every rank computes the same latent from the same (all-reduced) hidden
state and writes it to the same slots of the one cache (on CPU the ranks share its file): the
same bytes whoever writes last, and no rank waits on another's write before it reads.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.attention import PagedKV
from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.batch_invariant import InvariantAttention
from pdserve.engine.layers import RMSNorm
from pdserve.engine.linear import Linear
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.layers import attention_head_range
from pdserve.engine.rope import apply_rotary

# NOTE: DeepSeek-V3's q_a_layernorm and kv_a_layernorm keep RMSNorm's default epsilon.
_LATENT_NORM_EPS = 1e-6


class LatentAttention(InvariantAttention):
    """`InvariantAttention` over the latent: K and V caches hold its two halves, joined back
    into one key per token that is also the value (its leading ``kv_lora_rank`` values are the
    ones the caller keeps)."""

    def _gather(
        self, cache: PagedKV, table: torch.Tensor, num_blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super()._gather(cache, table, num_blocks)
        latent = torch.cat((keys, values), dim=-1)
        return latent, latent


class RawWeight(nn.Module):
    """A ``[out, in]`` weight read whole (never packed for a GEMM): ``kv_b_proj``, which the
    absorbed form splits per head."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class MlaAttention(nn.Module):
    """DeepSeek-V3's attention block (see the module's note)."""

    def __init__(self, config: ModelConfig, group: TensorParallelGroup) -> None:
        super().__init__()
        mla = config.mla
        if mla is None:
            raise ValueError("MlaAttention needs a config with mla set")
        self.mla = mla
        # NOTE: a rank holds its share of the query heads (q, kv_b and o by heads, o summed
        # over the ranks) and computes the whole latent: kv_a and its norm are replicated.
        self.num_heads = len(attention_head_range(config, group.shard))
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.q_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(config.hidden_size, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(config.hidden_size, mla.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(config.hidden_size, mla.latent_size, config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = RawWeight(
            self.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank
        )
        self.o_proj = Linear(
            self.num_heads * mla.v_head_dim, config.hidden_size, config.o_proj_bias, group
        )
        self.attn = LatentAttention(
            self.num_heads, 1, mla.latent_size, None, scale=mla.softmax_scale
        )

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        mla = self.mla
        num_tokens = hidden.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        # q_nope: [num_tokens, num_heads, nope], q_pe: [num_tokens, num_heads, rope]
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split(
            [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
        )
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        c = self.kv_a_layernorm(c)
        k_pe = k_pe[:, None, :]
        if rope is not None:
            q_pe = apply_rotary(q_pe, *rope)
            k_pe = apply_rotary(k_pe, *rope)
        # latent: [num_tokens, 1, latent_size], its halves written as K and V
        latent = torch.cat((c[:, None, :], k_pe), dim=-1)
        half = mla.latent_size // 2
        # w: [num_heads, nope + v, kv_lora_rank]
        w = self.kv_b_proj.weight.view(self.num_heads, -1, mla.kv_lora_rank)
        w_uk, w_uv = w[:, : mla.qk_nope_head_dim], w[:, mla.qk_nope_head_dim :]
        # q_latent: [num_tokens, num_heads, kv_lora_rank]
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w_uk)
        query = torch.cat((q_latent, q_pe), dim=-1)
        # attended: [num_tokens, num_heads, latent_size]; its c part weighted by attention
        attended = self.attn.forward(
            query, latent[..., :half], latent[..., half:], kv_cache[0], kv_cache[1], metadata
        )
        out = torch.einsum("nhc,hvc->nhv", attended[..., : mla.kv_lora_rank], w_uv)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * mla.v_head_dim))
