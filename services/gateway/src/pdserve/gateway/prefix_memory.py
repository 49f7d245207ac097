"""Which prompt prefixes each prefill holds, as far as this gateway can tell.

The gateway never asks a prefill what it caches: it remembers the block keys
(`pdserve.common.prefix_keys`) of the prompts it routed to each one, least recently routed
forgotten first, and within a bound per prefill (at most the prefill's pool, since a prefill
cannot cache more blocks than it has). That mirrors the prefill's own cache closely enough to
route by: a prefill evicts its least recently freed blocks first and frees a prompt's tail
before its head, and this memory touches a prompt's keys head last, so it too forgets a
prefix's tail first. It is an estimate: another gateway's traffic, a restart or a failed
attempt make it wrong until the next requests correct it, which costs a cache miss, never a
wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdserve.common.prefix_keys import BlockHash


class PrefixMemory:
    """Block keys per prefill instance, each an LRU bounded by `max_blocks_per_instance`.

    Args:
        max_blocks_per_instance: Most keys remembered for one instance.
    """

    def __init__(self, max_blocks_per_instance: int) -> None:
        if max_blocks_per_instance < 1:
            raise ValueError(f"max_blocks_per_instance must be >= 1, got {max_blocks_per_instance}")
        self.max_blocks_per_instance = max_blocks_per_instance
        self._keys: dict[str, OrderedDict[BlockHash, None]] = {}

    @property
    def instance_ids(self) -> frozenset[str]:
        """Instances with at least one remembered key."""
        return frozenset(self._keys)

    def num_blocks(self, instance_id: str) -> int:
        """Keys remembered for `instance_id`."""
        return len(self._keys.get(instance_id, ()))

    def num_matched_blocks(self, instance_id: str, keys: Sequence[BlockHash]) -> int:
        """How many leading `keys` (a prompt's block keys, in order) `instance_id` holds."""
        remembered = self._keys.get(instance_id)
        if not remembered:
            return 0
        for index, key in enumerate(keys):
            if key not in remembered:
                return index
        return len(keys)

    def record(
        self, instance_id: str, keys: Sequence[BlockHash], max_blocks: int | None = None
    ) -> None:
        """Remembers that `instance_id` computes (and caches) the blocks named by `keys`.

        Args:
            instance_id: The prefill the prompt was routed to.
            keys: The prompt's block keys, in order.
            max_blocks: The instance's own bound (its pool size), if smaller than the memory's.
        """
        if not keys:
            return
        remembered = self._keys.setdefault(instance_id, OrderedDict())
        # NOTE: tail first, so the head is the most recent and is forgotten last.
        for key in reversed(keys):
            remembered[key] = None
            remembered.move_to_end(key)
        limit = min(self.max_blocks_per_instance, max_blocks or self.max_blocks_per_instance)
        while len(remembered) > max(1, limit):
            remembered.popitem(last=False)

    def forget(self, instance_id: str) -> None:
        """Drops everything remembered for `instance_id` (it left, or restarted empty)."""
        self._keys.pop(instance_id, None)

    def retain(self, instance_ids: frozenset[str] | set[str]) -> None:
        """Forgets every instance not in `instance_ids`."""
        for instance_id in self.instance_ids - instance_ids:
            self.forget(instance_id)
