"""The router's bookkeeping: each role's candidates in pools of one KV layout with their scores
side by side, and the estimated loads behind the scores.

A score is lower-is-better: a prefill's queued prompt tokens, a decode's admissible blocks
negated, both corrected by what this gateway booked and saw end since the instance's last
report. The pools are rebuilt only when the registry's ``version`` changes and rescored on each
load report, booking and settlement, so the least-loaded instance of a pool is a `min` in C.
What a pick excludes scores `EXCLUDED` for that pick (`excluding`). A decode has room for a
request when its admissible blocks hold the request's lease (`lease_blocks`: the decode's own
rule).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

from pdserve.common.errors import PdserveError
from pdserve.common.generation import num_blocks_for
from pdserve.common.protocol import check_compatible
from pdserve.gateway.fleet.instance import InstanceRole, KvLayout
from pdserve.gateway.fleet.registry import InstanceEntry, Registry

# NOTE: a score no instance reaches: what a pick excludes is set to it for that pick.
EXCLUDED = sys.maxsize
# NOTE: the score of an instance that refused work for want of room (`Router.mark_full`),
# until its next load report or until work this gateway sent there ends.
FULL = sys.maxsize - 1

RESERVE_TOKENS = 32
"""Growth headroom (tokens) a decode keeps for a new lease beyond its prompt: the decode's
default ``--reserve-tokens``. A lease of n KV tokens takes ``ceil((n + min(RESERVE_TOKENS,
max_new_tokens)) / block_size)`` of the decode's admissible blocks."""


def lease_blocks(num_tokens: int, max_new_tokens: int, block_size: int) -> int:
    """The admissible blocks a decode gives a new lease of `num_tokens` KV tokens that may
    generate `max_new_tokens` more: its blocks now and its headroom (the decode's rule)."""
    return num_blocks_for(num_tokens + min(RESERVE_TOKENS, max_new_tokens), max(1, block_size))


def is_compatible(entry: InstanceEntry) -> bool:
    """Same protocol major as the gateway (any minor)."""
    return _is_compatible_version(entry.info.protocol_version)


@functools.lru_cache(maxsize=64)
def _is_compatible_version(version: str) -> bool:
    # NOTE: cached: every pick asks this of every instance, and a cluster has few versions.
    try:
        check_compatible(version)
    except PdserveError:
        return False
    return True


@dataclass
class Pool:
    """The routable instances of one role, model and KV layout, and their scores side by side
    (lower is better: queued prompt tokens of a prefill, minus the admissible blocks of a
    decode; both with what this gateway booked since the instance's last report)."""

    layout: KvLayout
    entries: list[InstanceEntry] = field(default_factory=list)
    scores: list[int] = field(default_factory=list)
    positions: dict[str, int] = field(default_factory=dict)
    _lacking: dict[frozenset[str], tuple[str, ...]] = field(default_factory=dict)

    def lacking(self, features: frozenset[str]) -> tuple[str, ...]:
        """The instances that do not advertise every one of `features` (found once per pool:
        a pool is rebuilt whenever the registry changes)."""
        found = self._lacking.get(features)
        if found is None:
            found = self._lacking[features] = tuple(
                e.instance_id for e in self.entries if not features <= set(e.info.features)
            )
        return found

    def least(self) -> int:
        return min(self.scores)

    def positions_scoring(self, score: int) -> list[int]:
        """Where `score` stands in `scores`, found in C (`list.index`)."""
        found: list[int] = []
        with contextlib.suppress(ValueError):
            while True:
                found.append(self.scores.index(score, found[-1] + 1 if found else 0))
        return found


def has_room(pool: Pool, least: int, room: tuple[int, int]) -> bool:
    """Whether the best decode of `pool` (score `least`) has room for a lease of `room`
    (tokens, max new tokens); a decode that reports no pool is taken at its word."""
    num_tokens, max_new_tokens = room
    if least == FULL:
        return False
    if -least >= lease_blocks(num_tokens, max_new_tokens, pool.layout.block_size):
        return True
    return any(pool.entries[at].load.num_total_blocks == 0 for at in pool.positions_scoring(least))


def could_ever_hold(pool: Pool, room: tuple[int, int]) -> bool:
    """Whether some decode of `pool` could hold a lease of `room` once it is idle."""
    num_blocks = lease_blocks(*room, pool.layout.block_size)
    return any(
        entry.load.num_total_blocks == 0 or entry.load.num_total_blocks >= num_blocks
        for entry in pool.entries
    )


@contextlib.contextmanager
def excluding(pools: dict[str, Pool], instance_ids: Collection[str]) -> Iterator[None]:
    """Scores the instances of `instance_ids` out of reach for one pick."""
    saved = []
    for instance_id in instance_ids:
        for pool in pools.values():
            at = pool.positions.get(instance_id)
            if at is not None:
                saved.append((pool, at, pool.scores[at]))
                pool.scores[at] = EXCLUDED
    try:
        yield
    finally:
        for pool, at, score in saved:
            pool.scores[at] = score


class EstimatedLoads:
    """The candidate pools of each role and model, and each instance's estimated load: its last
    report, plus the work this gateway booked there since, minus the work it saw end there
    since; an instance that refused work for want of room is scored `FULL` until its next
    report or until work there ends.

    Args:
        registry: Source of instances and their load (its load reports rescore them).
        on_rebuild: Called with the ids of all known instances when the pools are rebuilt.
    """

    def __init__(
        self, registry: Registry, on_rebuild: Callable[[set[str]], None] = lambda ids: None
    ) -> None:
        self._registry = registry
        self._on_rebuild = on_rebuild
        registry.add_load_listener(self.rescore)
        # NOTE: work this gateway routed to an instance since its last load report, keyed by
        # instance id: (load_seq it applies to, prompt tokens for prefill / blocks for decode).
        self._pending: dict[str, tuple[int, int]] = {}
        # NOTE: instances that refused work for want of room: id -> the load_seq it applies to.
        self._full: dict[str, int] = {}
        # NOTE: {(role, model): {KV layout fingerprint: pool}}, valid for one registry version.
        self._pools: dict[tuple[InstanceRole, str], dict[str, Pool]] = {}
        self._pools_version = -1

    def candidates(self, role: InstanceRole, model_name: str) -> list[InstanceEntry]:
        """Alive, non-draining, compatible instances of `role` serving `model_name`."""
        return [
            entry
            for entry in self._registry.alive(role, model_name)
            if not entry.load.is_draining and is_compatible(entry)
        ]

    def pools(self, role: InstanceRole, model_name: str) -> dict[str, Pool]:
        """The pools of `role` and `model_name` by KV fingerprint, rebuilt after the
        registry changed."""
        if self._pools_version != self._registry.version:
            self._pools.clear()
            self._pools_version = self._registry.version
            self._on_rebuild({e.instance_id for e in self._registry.entries()})
        pools = self._pools.get((role, model_name))
        if pools is None:
            pools = {}
            for entry in self.candidates(role, model_name):
                layout = entry.info.kv_layout
                pool = pools.setdefault(layout.fingerprint, Pool(layout))
                pool.positions[entry.instance_id] = len(pool.entries)
                pool.entries.append(entry)
                pool.scores.append(self._score(entry))
            self._pools[role, model_name] = pools
        return pools

    def invalidate(self) -> None:
        """Rebuilds the pools on their next use (an instance went silent since)."""
        self._pools_version = -1

    def is_routable(self, entry: InstanceEntry) -> bool:
        return self._registry.is_alive(entry) and not entry.load.is_draining

    def book(self, pool: Pool, at: int, amount: int) -> None:
        """Adds `amount` of work to the estimated load of the instance at `at` in `pool`."""
        entry = pool.entries[at]
        self._pending[entry.instance_id] = (entry.load_seq, self._pending_for(entry) + amount)
        pool.scores[at] = self._score(entry)

    def settle(self, instance_id: str, amount: int, *, has_run: bool) -> None:
        """Takes `amount` of booked work off the instance's estimated load; with `has_run`
        (the work ran there and ended, freeing room) it is no longer marked full."""
        entry = self._registry.get(instance_id)
        if entry is None:
            return
        self._pending[instance_id] = (entry.load_seq, self._pending_for(entry) - amount)
        if has_run:
            self._full.pop(instance_id, None)
        self.rescore(entry)

    def mark_full(self, instance_id: str) -> None:
        """The instance refused a request for want of room (a decode's blocks, a prefill's
        queue) although its estimate showed some: it takes no work under `require_room`
        until its next load report, or until work this gateway sent there ends."""
        entry = self._registry.get(instance_id)
        if entry is not None:
            self._full[instance_id] = entry.load_seq
            self.rescore(entry)

    def rescore(self, entry: InstanceEntry) -> None:
        """A load report arrived, or booked work settled: the instance's score again."""
        if self._pools_version != self._registry.version:
            return
        pools = self._pools.get((entry.info.role, entry.info.model_name), {})
        pool = pools.get(entry.info.kv_layout.fingerprint)
        at = pool.positions.get(entry.instance_id) if pool else None
        if pool is not None and at is not None and pool.entries[at] is entry:
            pool.scores[at] = self._score(entry)

    def unreported_work(self, instance_id: str) -> int:
        """What this gateway adds to the instance's last report: work it booked there since,
        minus work it saw end there since (prompt tokens of a prefill, blocks of a decode)."""
        entry = self._registry.get(instance_id)
        return self._pending_for(entry) if entry is not None else 0

    def _score(self, entry: InstanceEntry) -> int:
        if self._full.get(entry.instance_id, -1) == entry.load_seq:
            return FULL
        if entry.info.role is InstanceRole.PREFILL:
            # NOTE: work settled since the report may include some the report already left
            # out (it ended just before the report): never below an idle prefill.
            return max(0, entry.load.num_queued_prompt_tokens + self._pending_for(entry))
        return self._pending_for(entry) - entry.load.num_admissible_blocks

    def _pending_for(self, entry: InstanceEntry) -> int:
        seq, amount = self._pending.get(entry.instance_id, (entry.load_seq, 0))
        return amount if seq == entry.load_seq else 0
