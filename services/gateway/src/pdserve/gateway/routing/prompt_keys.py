"""A prompt's block keys per KV layout, computed once per attempt."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.prefix_keys import BlockHash, prefix_block_keys
from pdserve.gateway.fleet.instance import KvLayout


class PromptKeys:
    """A prompt's block keys per KV layout, computed once (a request keeps them across its
    attempts: hashing a long prompt costs more than a decision)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self._token_ids = token_ids
        self._keys: dict[tuple[str, int], list[BlockHash]] = {}
        self._reusable: dict[tuple[str, int], list[BlockHash]] = {}

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    def of(self, layout: KvLayout) -> list[BlockHash]:
        """The keys of every full block under `layout`."""
        block_size = max(1, layout.block_size)
        cached = self._keys.get((layout.fingerprint, block_size))
        if cached is None:
            cached = prefix_block_keys(layout.fingerprint, self._token_ids, block_size)
            self._keys[layout.fingerprint, block_size] = cached
        return cached

    def reusable(self, layout: KvLayout) -> list[BlockHash]:
        """The keys of the blocks a prefill may take from its cache for this prompt."""
        # NOTE: a prefill always computes the last token: its logits give the first token.
        block_size = max(1, layout.block_size)
        reusable = self._reusable.get((layout.fingerprint, block_size))
        if reusable is None:
            reusable = self.of(layout)[: (len(self._token_ids) - 1) // block_size]
            self._reusable[layout.fingerprint, block_size] = reusable
        return reusable
