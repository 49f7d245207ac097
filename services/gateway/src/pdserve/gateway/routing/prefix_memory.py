"""Which prompt prefixes each prefill holds, as far as this gateway can tell.

The gateway never asks a prefill what it caches: it remembers the block keys
(`pdserve.common.prefix_keys`) of the prompts it routed to each one, least recently routed
forgotten first, and within a bound per prefill (the most free blocks it keeps cached, as its
load report says, or else its pool, since a prefill cannot cache more blocks than it has; a
prefill that caches none is not remembered to). That mirrors the prefill's own cache closely
enough to route by: a prefill evicts its least recently freed blocks first and frees a prompt's
tail before its head, and this memory touches a prompt's keys head last, so it too forgets a
prefix's tail first. It is an estimate: another gateway's traffic, a restart or a failed
attempt make it wrong until the next requests correct it, which costs a cache miss, never a
wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence, Set

from pdserve.common.prefix_keys import BlockHash


class PrefixMemory:
    """Block keys per prefill instance, each an LRU bounded by `max_blocks_per_instance`, and
    which instances hold each first block, so a prompt is matched against only the instances
    that hold its first block (a key names its block and every block before it, so a first
    block's key is never another block's).

    Args:
        max_blocks_per_instance: Most keys remembered for one instance.
    """

    def __init__(self, max_blocks_per_instance: int) -> None:
        if max_blocks_per_instance < 1:
            raise ValueError(f"max_blocks_per_instance must be >= 1, got {max_blocks_per_instance}")
        self.max_blocks_per_instance = max_blocks_per_instance
        self._keys: dict[str, OrderedDict[BlockHash, None]] = {}
        # NOTE: first blocks only: a set per key of every block would double the memory.
        self._first_holders: dict[BlockHash, set[str]] = {}

    @property
    def instance_ids(self) -> frozenset[str]:
        """Instances with at least one remembered key."""
        return frozenset(self._keys)

    def num_blocks(self, instance_id: str) -> int:
        """Keys remembered for `instance_id`."""
        return len(self._keys.get(instance_id, ()))

    def holds(self, instance_id: str, key: BlockHash) -> bool:
        """Whether `instance_id` is remembered to hold the block named by `key`."""
        return key in self._keys.get(instance_id, ())

    def num_matched_blocks(self, instance_id: str, keys: Sequence[BlockHash]) -> int:
        """How many leading `keys` (a prompt's block keys, in order) `instance_id` holds."""
        remembered = self._keys.get(instance_id)
        if not remembered:
            return 0
        # NOTE: a binary search: what an instance holds of a chain is always a prefix of it.
        # Whenever a block's key is touched, every earlier block's is too, and after it
        # (`record` walks tail first), so the LRU forgets a chain from its tail.
        low, high = 0, len(keys)
        while low < high:
            middle = (low + high) // 2
            if keys[middle] in remembered:
                low = middle + 1
            else:
                high = middle
        return low

    def holders(self, keys: Sequence[BlockHash]) -> Set[str]:
        """The instances that hold at least the first of `keys` (the others match none)."""
        return self._first_holders.get(keys[0], frozenset()) if keys else frozenset()

    def matches(self, keys: Sequence[BlockHash]) -> dict[str, int]:
        """`num_matched_blocks` of every instance in `holders(keys)`, looking only at those."""
        return {i: self.num_matched_blocks(i, keys) for i in self.holders(keys)}

    def record(
        self, instance_id: str, keys: Sequence[BlockHash], max_blocks: int | None = None
    ) -> None:
        """Remembers that `instance_id` computes (and caches) the blocks named by `keys`.

        Args:
            instance_id: The prefill the prompt was routed to.
            keys: The prompt's block keys, in order.
            max_blocks: The instance's own bound (the most blocks it keeps cached, or its pool
                size), if smaller than the memory's.
        """
        if not keys:
            return
        remembered = self._keys.setdefault(instance_id, OrderedDict())
        self._first_holders.setdefault(keys[0], set()).add(instance_id)
        # NOTE: tail first, so the head is the most recent and is forgotten last.
        for key in reversed(keys):
            remembered[key] = None
            remembered.move_to_end(key)
        limit = min(self.max_blocks_per_instance, max_blocks or self.max_blocks_per_instance)
        while len(remembered) > max(1, limit):
            key, _ = remembered.popitem(last=False)
            self._unhold(key, instance_id)

    def forget(self, instance_id: str) -> None:
        """Drops everything remembered for `instance_id` (it left, or restarted empty)."""
        for key in self._keys.pop(instance_id, ()):
            self._unhold(key, instance_id)

    def retain(self, instance_ids: frozenset[str] | set[str]) -> None:
        """Forgets every instance not in `instance_ids`."""
        for instance_id in self.instance_ids - instance_ids:
            self.forget(instance_id)

    def _unhold(self, key: BlockHash, instance_id: str) -> None:
        holders = self._first_holders.get(key)
        if holders is not None:
            holders.discard(instance_id)
            if not holders:
                del self._first_holders[key]
