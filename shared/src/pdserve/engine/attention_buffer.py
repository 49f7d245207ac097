"""A reusable destination for K/V gathered from the paged cache."""

from __future__ import annotations

import torch


class KVGatherBuffer:
    """Reusable destination for K/V gathered through block tables.

    NOTE: a fresh multi-megabyte tensor per layer and step is mapped anew by the allocator and
    page-faulted on first write, which on CPU costs about as much as the copy itself.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies the given blocks of one layer; valid until the next ``gather``.

        Returns:
            ``(k, v)``, each ``[len(block_ids), block_size, num_kv_heads, head_dim]``.
        """
        num_blocks = block_ids.numel()
        if (
            not self._buffers
            or self._buffers[0].shape[0] < num_blocks
            or (
                self._buffers[0].dtype != k_cache.dtype or self._buffers[0].device != k_cache.device
            )
        ):
            # Grow with headroom so that slowly growing contexts do not reallocate every step.
            capacity = max(num_blocks + num_blocks // 4, 16)
            shape = (capacity, *k_cache.shape[1:])
            self._buffers = [
                torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device) for _ in range(2)
            ]
        k_out, v_out = (buffer[:num_blocks] for buffer in self._buffers)
        torch.index_select(k_cache, 0, block_ids, out=k_out)
        torch.index_select(v_cache, 0, block_ids, out=v_out)
        return k_out, v_out
