"""Batch-invariant numerics: a token's logits do not depend on the other rows of its step, on
how its prompt was chunked, on how much of it came from the prefix cache, nor on whether its
K/V were computed by a prefill or a decode (`EngineConfig.deterministic`).

A kernel that reduces (a GEMM, attention's softmax and weighted sum) may pick its reduction
order from the shape of the call, and in bfloat16 a last-bit difference flips a token. Measured
on this engine's CPU kernels (tests/unit/engine/test_batch_invariant.py checks each on the CPU
it runs on):

* **Projections.** oneDNN's GEMM gives a row the same result for any number of rows from two
  up to 32 (on a CPU without AMX, for any number from two), but a one-row call takes another
  path (a GEMV that splits the inner dimension over the threads) whose sums differ from 2048
  inputs up, and on a CPU with AMX a call of more than 32 rows takes the AMX kernels, which
  sum in another order. A one-row call runs as two rows (`MIN_ROWS`): a decode step of one
  user streams the same weights either way; a call of more rows runs 32 at a time
  (`pdserve.engine.linear.invariant_rows`). The int8 projection, which switches kernels by
  row count, keeps one kernel; dense experts run on oneDNN's GEMM over a ``[out, in]``
  layout (torch.mm's bf16 GEMM over ``[in, out]`` sums differently from 7 rows on AMX). An
  int4 projection keeps pdserve's int4 kernel (its rows are independent) or, on a CPU with
  AMX, runs every call on `pdserve.engine.amx_gemm` (one summation order on AMX tiles; a
  prefill's rows at AMX's speed), so under this mode an int4 model's instances agree bit for
  bit when all have AMX or none has.
* **Attention.** torch's CPU SDPA splits the keys into blocks of 512 (one block when there
  are fewer) and its sums depend on that split and on the queries sharing a call: a decode
  padded to its group's longest context, or a prefill's causal call, attend differently from
  one another. `InvariantAttention` attends every query token the same way wherever it runs:
  as its own batch element (its GQA group of heads as the query length) over its sequence's
  keys up to its position, padded with masked keys to the next multiple of `KEY_SPAN`: the
  padded length is a function of the position alone, so the split is too, and masked keys
  add exact zeros. Queries of one padded length share a call (decodes of similar contexts; a
  prefill's 64 positions at a time), and a prefill computes each token's attention exactly as
  a decode of that position would.
* **Norms, activations, RoPE, the router's softmax, the sampler's log-softmax** reduce within
  one row and already give the same result for any number of rows.

Under tensor parallelism the partial sums are reduced in rank order, the same for every step:
a prefill and a decode with the same ``--tensor-parallel-size``, dtype and block size agree bit
for bit; with different sizes they do not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention import PagedKV, SdpaAttention, with_sink
from pdserve.engine.attention_metadata import PrefillSpan
from pdserve.engine.moe import Experts

MIN_ROWS = 2
"""The fewest rows a projection runs with (a one-row call is padded to two)."""

KEY_SPAN = 64
"""A query attends over its keys padded to a multiple of this many: torch's CPU SDPA splits
keys into blocks of 512 (one block when there are fewer), so the padded length, the same for a
position wherever it is computed, fixes the split. Queries padded to the same length share a
call: a longer span means fewer calls and more masked keys."""

INVARIANT_BACKEND = "sdpa-invariant"


def make_batch_invariant(model: nn.Module) -> tuple[int, int]:
    """Sets every projection of `model` that supports it to batch-invariant use; an int4
    projection runs on the AMX GEMM of one summation order where the CPU has one
    (`Int4Linear.use_fixed_order_gemm`: its prefill rows then run at AMX's speed).

    Returns:
        How many modules were set, and how many of them run on the AMX GEMM.
    """
    count = fixed_order = 0
    for module in model.modules():
        if hasattr(module, "min_rows"):
            setattr(module, "min_rows", MIN_ROWS)  # noqa: B010 (nn.Module's typed __setattr__)
            if isinstance(module, Experts):
                module.lay_out_for_onednn()
            use_fixed_order = getattr(module, "use_fixed_order_gemm", None)
            if use_fixed_order is not None and use_fixed_order():
                fixed_order += 1
            count += 1
    return count, fixed_order


def padded_len(num_keys: int, span: int) -> int:
    """The key length a query with `num_keys` keys attends over: the next multiple of `span`."""
    return max(1, -(-num_keys // span)) * span


class InvariantAttention(SdpaAttention):
    """SDPA over the paged cache with the same arithmetic for a token in any step (see the
    module's note); the engine's attention under ``deterministic``."""

    key_span = KEY_SPAN
    cpu_kernel = False

    def _decode_static(self, q: torch.Tensor, cache: PagedKV) -> torch.Tensor:
        raise RuntimeError("batch-invariant attention has no graph path (enforce_eager)")

    def _attend_each(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        query_pos: torch.Tensor,
    ) -> torch.Tensor:
        """Attends each query token as its own batch element.

        Args:
            q: ``[num_queries, num_heads, head_dim]``.
            keys: ``[1 or num_queries, padded_len, num_kv_heads, head_dim]``: one sequence's
                keys that every query shares, or each query's own.
            values: As ``keys``.
            query_pos: ``[num_queries]`` each query's position: it sees the keys up to it.
        """
        num_queries = q.shape[0]
        padded = keys.shape[1]
        key_pos = torch.arange(padded, device=q.device)[None, :]
        mask = key_pos <= query_pos[:, None]
        if self.sliding_window is not None:
            mask &= key_pos > query_pos[:, None] - self.sliding_window
        attn_mask = mask[:, None, None, :]
        if self.sinks is not None:
            # NOTE: the sink key joins the shared keys before they are expanded per query.
            logits = self.sinks.view(1, self.num_kv_heads, self.group_size, 1)
            attn_mask, keys, values = with_sink(attn_mask, keys, values, logits, 1, q.dtype)
        shape = (num_queries, self.num_kv_heads, keys.shape[1], self.head_dim)
        # NOTE: a prefill's queries share one sequence's keys: a stride-0 batch, no copies.
        keys, values = keys.transpose(1, 2).expand(shape), values.transpose(1, 2).expand(shape)
        # q_grouped: [num_queries, num_kv_heads, group_size, head_dim]
        q_grouped = q.reshape(num_queries, self.num_kv_heads, self.group_size, self.head_dim)
        out = F.scaled_dot_product_attention(
            q_grouped, keys, values, attn_mask=attn_mask, scale=self.scale
        )
        return out.reshape(num_queries, self.num_heads, self.head_dim)

    def _span(self, block_size: int) -> int:
        """`key_span` rounded up to whole blocks."""
        return padded_len(self.key_span, block_size)

    def _gather(
        self, cache: PagedKV, table: torch.Tensor, num_blocks: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[rows, num_blocks * block_size, num_kv_heads, head_dim]`` keys and values of the
        block table's rows (``[rows, width]``), padded with block 0, which masks hide."""
        k_cache, v_cache = cache.k_cache, cache.v_cache
        if table.shape[1] < num_blocks:
            table = F.pad(table, (0, num_blocks - table.shape[1]))
        blocks = table[:, :num_blocks].reshape(-1)
        rows = table.shape[0]
        keys = k_cache.index_select(0, blocks).view(rows, -1, *k_cache.shape[2:])
        values = v_cache.index_select(0, blocks).view(rows, -1, *v_cache.shape[2:])
        return keys, values

    def _decode(self, q: torch.Tensor, cache: PagedKV) -> torch.Tensor:
        # NOTE: decodes come sorted by context length: those padded to the same length are
        # consecutive and attend in one call.
        metadata = cache.metadata
        block_size = metadata.block_size
        span = self._span(block_size)
        lens = metadata.context_lens[: q.shape[0]].tolist()
        padded = [padded_len(n, span) for n in lens]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        start = 0
        while start < len(lens):
            end = start + 1
            while end < len(lens) and padded[end] == padded[start]:
                end += 1
            keys, values = self._gather(
                cache, metadata.block_table[start:end], padded[start] // block_size
            )
            query_pos = metadata.context_lens[start:end].to(q.device) - 1
            out[start:end] = self._attend_each(q[start:end], keys, values, query_pos)
            start = end
        return out

    def _prefill(
        self, span: PrefillSpan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKV
    ) -> torch.Tensor:
        # NOTE: the new K/V were written to the cache first; reading them back from it gives
        # the values a later decode reads. A query at position p attends over
        # padded_len(p + 1) keys, as the decode of that position would.
        block_size = cache.metadata.block_size
        key_span = self._span(block_size)
        table = cache.metadata.block_table[span.seq_index : span.seq_index + 1]
        last = padded_len(span.context_len, key_span)
        keys, values = self._gather(cache, table, last // block_size)
        out = torch.empty(
            (span.token_end - span.token_start, self.num_heads, self.head_dim),
            dtype=q.dtype,
            device=q.device,
        )
        position = span.num_computed_tokens
        while position < span.context_len:
            padded = padded_len(position + 1, key_span)
            end = min(padded, span.context_len)
            rows = slice(position - span.num_computed_tokens, end - span.num_computed_tokens)
            query_pos = torch.arange(position, end, device=q.device)
            out[rows] = self._attend_each(
                q[span.token_start + rows.start : span.token_start + rows.stop],
                keys[:, :padded],
                values[:, :padded],
                query_pos,
            )
            position = end
        return out
