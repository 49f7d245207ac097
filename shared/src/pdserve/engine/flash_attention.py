"""Optional flash-attn path (CUDA only): paged varlen attention straight on the block tables.

Two implementations can serve it, whichever is importable, the newer first:

* flash-attn 4 (``flash-attn-4`` on PyPI, the CuTe DSL kernels in ``flash_attn.cute``): pure
  Python wheels that compile their kernels on first use; any page size.
* flash-attn 2 (``flash-attn``, the ``flash_attn`` extension built with ``nvcc``): pages whose
  size is a multiple of 256.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from pdserve.engine.attention import PagedAttention, PagedKV
from pdserve.engine.attention_metadata import AttentionMetadata


class FlashImplementation(NamedTuple):
    """The importable flash-attn: its name, varlen function and page-size rule.

    Attributes:
        name: ``flash-attn-4`` or ``flash-attn-2``.
        varlen_func: ``flash_attn_varlen_func`` of that implementation.
        block_size_multiple: Page sizes it reads must be multiples of this.
    """

    name: str
    varlen_func: Any
    block_size_multiple: int


def _find_implementation() -> FlashImplementation | None:  # pragma: no cover - needs flash-attn
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
    except Exception:
        # NOTE: a broken install (a CuTe DSL library missing, say) must not stop SDPA.
        pass
    else:
        return FlashImplementation("flash-attn-4", fa4_varlen, 1)
    try:
        from flash_attn import flash_attn_varlen_func as fa2_varlen
    except Exception:
        return None
    # NOTE: flash-attn 2 reads a paged KV cache only with page sizes that are multiples of 256.
    return FlashImplementation("flash-attn-2", fa2_varlen, 256)


FLASH = _find_implementation()
"""The flash-attn this process would use, or ``None`` when none is importable."""


def flash_attn_unusable_reason(
    device: torch.device, dtype: torch.dtype, block_size: int
) -> str | None:
    """Why the flash-attn path cannot run here, or ``None`` when it can."""
    if FLASH is None:
        return "flash_attn is not installed (neither flash-attn-4 nor flash-attn 2)"
    if device.type != "cuda":
        return "flash-attn needs a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return "flash-attn needs float16 or bfloat16"
    if block_size % FLASH.block_size_multiple != 0:
        return (
            f"{FLASH.name} paged KV needs block_size to be a multiple of "
            f"{FLASH.block_size_multiple}"
        )
    return None


class FlashAttention(PagedAttention):
    """Attention for one layer with ``flash_attn_varlen_func`` over the paged cache.

    All sequences of the batch, decodes and prefill chunks alike, go into one call: queries are
    packed by ``cu_seqlens_q``, keys and values are read from the cache through the block table
    up to each sequence's context length, and the causal mask is aligned bottom-right, which is
    exactly chunked prefill on top of cached KV.
    """

    @property
    def implementation(self) -> FlashImplementation:
        """The importable flash-attn (the backend is chosen only where one is)."""
        if FLASH is None:
            raise RuntimeError("flash_attn is not installed")
        return FLASH

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKV
    ) -> torch.Tensor:
        k_cache, v_cache, metadata = cache
        tensors = _flash_tensors(metadata)
        window = self.sliding_window
        implementation = self.implementation
        common = {
            "cu_seqlens_q": tensors["cu_seqlens_q"],
            "max_seqlen_q": int(metadata.query_lens.max()),
            "max_seqlen_k": int(metadata.context_lens.max()),
            "softmax_scale": self.scale,
            "causal": True,
        }
        if implementation.name == "flash-attn-4":
            result = implementation.varlen_func(
                q,
                k_cache,
                v_cache,
                seqused_k=tensors["seqused_k"],
                page_table=tensors["block_table"],
                window_size=(None, None) if window is None else (window - 1, 0),
                **common,
            )
            # NOTE: flash-attn 4 returns (out, lse).
            out: torch.Tensor = result[0] if isinstance(result, tuple) else result
            return out
        out = implementation.varlen_func(
            q,
            k_cache,
            v_cache,
            cu_seqlens_k=tensors["cu_seqlens_k"],
            block_table=tensors["block_table"],
            window_size=(-1, -1) if window is None else (window - 1, 0),
            **common,
        )
        return out

    def _decode_static(
        self, q: torch.Tensor, cache: PagedKV
    ) -> torch.Tensor:  # pragma: no cover - needs flash-attn 2 on CUDA
        """A graph step's decodes with ``flash_attn_with_kvcache``: K/V read in place through
        the block table, lengths from the device (flash-attn 2 only, `GRAPH_CAPTURABLE`)."""
        from flash_attn import flash_attn_with_kvcache

        k_cache, v_cache, metadata = cache
        window = self.sliding_window
        # out: [num_decodes, 1, num_heads, head_dim]
        out = flash_attn_with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=metadata.context_lens.to(torch.int32),
            block_table=metadata.block_table.to(torch.int32),
            softmax_scale=self.scale,
            causal=True,
            window_size=(-1, -1) if window is None else (window - 1, 0),
        )
        return out.squeeze(1)


GRAPH_CAPTURABLE = ("flash-attn-2",)
"""The flash-attn implementations whose decode a graph step can capture."""


def _flash_tensors(metadata: AttentionMetadata) -> dict[str, Any]:
    key = "flash_tensors"
    cached = metadata.derived.get(key)
    if cached is None:
        device = metadata.slot_mapping.device
        # lens: [2, num_seqs] query and context lengths (on the device when the step put them
        # there before the forward: then nothing here copies from the host)
        lens = metadata.device_lens
        if lens is None:
            lens = torch.stack([metadata.query_lens, metadata.context_lens]).to(device)
        lens = lens.to(torch.int32)
        # cu_seqlens: [2, num_seqs + 1]
        cu_seqlens = torch.nn.functional.pad(lens.cumsum(1, dtype=torch.int32), (1, 0))
        cached = {
            "cu_seqlens_q": cu_seqlens[0],
            "cu_seqlens_k": cu_seqlens[1],
            "seqused_k": lens[1],
            "block_table": metadata.block_table.to(torch.int32).contiguous(),
        }
        metadata.derived[key] = cached
    return cached
