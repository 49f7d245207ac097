"""The router's choice over its pools: a pick before it is booked (`PoolChoice`), and the
prefill rule of `pdserve.gateway.routing.policy` applied to the pools' flat score lists."""

from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.gateway.fleet.registry import InstanceEntry
from pdserve.gateway.routing.policy import CacheRouting, RouteReason
from pdserve.gateway.routing.pools import EXCLUDED, FULL, Pool
from pdserve.gateway.routing.prefix_memory import PrefixMemory
from pdserve.gateway.routing.prompt_keys import PromptKeys


@dataclass(frozen=True)
class PoolChoice:
    """A pick before it is booked: each instance as its pool and position there."""

    prefill_pool: Pool
    prefill_at: int
    decode_pool: Pool
    decode_at: int
    reason: RouteReason
    num_matched_blocks: int
    num_shared_blocks: int = 0

    @property
    def prefill(self) -> InstanceEntry:
        return self.prefill_pool.entries[self.prefill_at]

    @property
    def decode(self) -> InstanceEntry:
        return self.decode_pool.entries[self.decode_at]


def choose_prefill_in_pools(
    usable: list[tuple[Pool, int]],
    keys: PromptKeys,
    cache_routing: CacheRouting,
    memory: PrefixMemory,
    rng: random.Random,
) -> tuple[Pool, int, RouteReason, int]:
    """The rule of `pdserve.gateway.routing.policy`: among prefills within the balance
    of the least loaded, the longest cached prefix (then the fewest queued tokens); else
    the fewest queued tokens. Equally good ones at random. `usable` pairs each pool
    with its least score.

    Returns:
        The prefill's pool, its position there, why it was chosen and its matched blocks.
    """
    least = min(pool_least for _, pool_least in usable)
    if cache_routing.is_enabled:
        within = min(least + cache_routing.balance_tokens, FULL - 1)
        best: tuple[int, int] = (1, -EXCLUDED)  # (matched blocks, -score): higher wins
        ties: list[tuple[Pool, int]] = []
        for pool, _ in usable:
            reusable = keys.reusable(pool.layout)
            # NOTE: the load first: a hot prefix has many holders, most of them too busy.
            for instance_id in memory.holders(reusable):
                at = pool.positions.get(instance_id)
                if at is None or pool.scores[at] > within:
                    continue
                rank = (memory.num_matched_blocks(instance_id, reusable), -pool.scores[at])
                if rank > best:
                    best, ties = rank, [(pool, at)]
                elif rank == best:
                    ties.append((pool, at))
        if ties:
            pool, at = rng.choice(ties)
            return pool, at, RouteReason.PREFIX, best[0]
    least_loaded = [
        (pool, at)
        for pool, pool_least in usable
        if pool_least == least
        for at in pool.positions_scoring(least)
    ]
    pool, at = rng.choice(least_loaded)
    return pool, at, RouteReason.LOAD, 0
