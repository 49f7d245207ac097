"""pdserve's decode attention on the CPU (``shared/csrc/decode_attention.cpp``): one query
token per sequence over its paged bfloat16 K/V, read through its block table where they lie.

torch's SDPA needs each decode's keys and values gathered into a padded copy first; on a
one-row decode step of the default model that gather and the SDPA calls took about 2.5 ms of
12 (30 layers). This kernel walks the block table instead: per KV head, the scores of its
query heads against each key (VDPBF16PS, float32 sums), a float32 softmax (with the head's sink
logit where the model has one, gpt-oss), the values weighted in float32 and rounded once to
bf16. It runs where the compiled module is installed and the CPU has AVX512-BF16, for bf16
K/V, 1 to 8 query heads per KV head and a head size that is a multiple of 32 up to 256, on
one torch thread; `SdpaAttention` falls back to SDPA elsewhere. A float32 cache (``--dtype auto``
on a CPU without native bf16) runs the same steps in eight-lane FMAs where the CPU has AVX2 (the
gather and SDPA took 5 ms of a one-row float32 step there).
"""

from __future__ import annotations

import torch

import pdserve.engine.cpu_kernels as cpu_kernels

available = cpu_kernels.available


def takes(q: torch.Tensor, k_cache: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether the kernel takes a decode step's attention of `q` (``[n, heads, head_dim]``)
    over `k_cache` (contiguous; its V cache laid out alike)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    is_f32 = q.dtype == torch.float32
    return (
        q.dtype in (torch.bfloat16, torch.float32)
        and k_cache.dtype == q.dtype
        and q.device.type == "cpu"
        # NOTE: the kernel reads the cache as [blocks, block_size, kv_heads, head_dim] rows; a
        # tensor-parallel rank's cache is a view of its heads in a wider one.
        and k_cache.is_contiguous()
        and num_heads % num_kv_heads == 0
        and 1 <= num_heads // num_kv_heads <= 8
        and head_dim % 32 == 0
        and head_dim <= 256
        and torch.get_num_threads() == 1
        and (cpu_kernels.f32_available() if is_f32 else available())
    )


def decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one query token per sequence.

    Args:
        q: ``[n, num_heads, head_dim]`` bfloat16 (or float32).
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype.
        v_cache: As `k_cache`.
        tables: ``[n, width]`` int32 block ids of each sequence (contiguous rows).
        lens: ``[n]`` int32 keys of each sequence (its query is the last).
        scale: The softmax scale.
        window: Keys a query sees at most (itself included), or None for all.
        sinks: ``[num_heads]`` float32 sink logits, or None.

    Returns:
        ``[n, num_heads, head_dim]``, q's dtype.
    """
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32 and tables.is_contiguous()
    q = q.contiguous()
    num_seqs, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    cpu_kernels.kernel("decode_attention", q.dtype)(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        num_seqs,
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        scale,
        window or 0,
        0 if sinks is None else sinks.data_ptr(),
        out.data_ptr(),
    )
    return out
