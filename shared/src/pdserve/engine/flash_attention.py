"""Optional flash-attn path (CUDA only): paged varlen attention straight on the block tables."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.engine.attention_metadata import AttentionMetadata

_flash_attn_varlen_func: Any
try:  # pragma: no cover - exercised only where flash-attn is installed
    import flash_attn

    _flash_attn_varlen_func = flash_attn.flash_attn_varlen_func
except ImportError:  # pragma: no cover - the CPU default
    _flash_attn_varlen_func = None

# NOTE: upstream flash-attn 2 reads a paged KV cache only with page sizes that are multiples of 256.
FLASH_BLOCK_SIZE_MULTIPLE = 256


def flash_attn_unusable_reason(
    device: torch.device, dtype: torch.dtype, block_size: int
) -> str | None:
    """Why the flash-attn path cannot run here, or ``None`` when it can."""
    if _flash_attn_varlen_func is None:
        return "flash_attn is not installed"
    if device.type != "cuda":
        return "flash-attn needs a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return "flash-attn needs float16 or bfloat16"
    if block_size % FLASH_BLOCK_SIZE_MULTIPLE != 0:
        return (
            f"flash-attn paged KV needs block_size to be a multiple of {FLASH_BLOCK_SIZE_MULTIPLE}"
        )
    return None


class FlashAttention:
    """Attention for one layer with ``flash_attn_varlen_func`` over the paged cache.

    All sequences of the batch, decodes and prefill chunks alike, go into one call: queries are
    packed by ``cu_seqlens_q``, keys and values are read from the cache through ``block_table``
    up to each sequence's context length, and the causal mask is aligned bottom-right, which is
    exactly chunked prefill on top of cached KV.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None
    ) -> None:
        if _flash_attn_varlen_func is None:
            raise RuntimeError("flash_attn is not installed")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.window_size = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Same contract as ``SdpaAttention.forward``."""
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, metadata.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, metadata.slot_mapping, v)
        tensors = _flash_tensors(metadata)
        assert _flash_attn_varlen_func is not None
        out: torch.Tensor = _flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=tensors["cu_seqlens_q"],
            cu_seqlens_k=tensors["cu_seqlens_k"],
            max_seqlen_q=int(metadata.query_lens.max()),
            max_seqlen_k=int(metadata.context_lens.max()),
            softmax_scale=self.scale,
            causal=True,
            window_size=self.window_size,
            block_table=tensors["block_table"],
        )
        return out


def _flash_tensors(metadata: AttentionMetadata) -> dict[str, Any]:
    key = "flash_tensors"
    cached = metadata.derived.get(key)
    if cached is None:
        device = metadata.slot_mapping.device
        zero = torch.zeros(1, dtype=torch.int32)
        cached = {
            "cu_seqlens_q": torch.cat([zero, metadata.query_lens.cumsum(0).to(torch.int32)]).to(
                device
            ),
            "cu_seqlens_k": torch.cat([zero, metadata.context_lens.cumsum(0).to(torch.int32)]).to(
                device
            ),
            "block_table": metadata.block_table.to(torch.int32),
        }
        metadata.derived[key] = cached
    return cached
