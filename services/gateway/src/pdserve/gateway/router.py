"""Picks a compatible prefill/decode pair for one attempt of a request.

Candidates are alive, not draining, speak our protocol major, serve the model, and are not
excluded by the caller (instances that already failed this request). A pair must share the KV
layout fingerprint. The prefill is chosen by the rule of `pdserve.gateway.routing_policy`: the
one believed to hold the longest prefix of the prompt in its prefix cache
(`pdserve.gateway.prefix_memory`) unless it is much busier than the least-loaded one, else the
one with the fewest queued prompt tokens. The decode with the most admissible blocks (free minus
reserved headroom) follows. Both loads are the instance's last report corrected by what this
gateway saw since: work it sent there is added (a burst of requests between two heartbeats
spreads out instead of piling onto one instance), work it saw end there is taken off again
(`Router.settle`: a prefill that finished its prompts since its report is not taken for as
busy as it reported). Ties are broken at random.

A decision does not scan the registry: the candidates of each role, model and KV layout are
kept with their scores in flat lists (rebuilt only when the registry's `version` changes,
rescored on each load report and booking), so the least-loaded one is a `min` in C, and only
the prefills that hold the prompt's first block are asked how much of it they hold. The
prompt's block keys (a SHA-256 chain) are computed once per attempt (`PromptKeys`).
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import num_blocks_for
from pdserve.common.prefix_keys import BlockHash, prefix_block_keys
from pdserve.common.protocol import check_compatible
from pdserve.gateway.instance import InstanceInfo, InstanceRole, KvLayout
from pdserve.gateway.prefix_memory import PrefixMemory
from pdserve.gateway.registry import InstanceEntry, Registry
from pdserve.gateway.routing_policy import CacheRouting, RouteReason

# NOTE: a score no instance reaches: what a pick excludes is set to it for that pick.
_EXCLUDED = sys.maxsize
# NOTE: the score of an instance that refused work for want of room (`Router.mark_full`),
# until its next load report or until work this gateway sent there ends.
_FULL = sys.maxsize - 1

RESERVE_TOKENS = 32
"""Growth headroom (tokens) a decode keeps for a new lease beyond its prompt: the decode's
default ``--reserve-tokens``. A lease of n KV tokens takes ``ceil((n + min(RESERVE_TOKENS,
max_new_tokens)) / block_size)`` of the decode's admissible blocks."""


def lease_blocks(num_tokens: int, max_new_tokens: int, block_size: int) -> int:
    """The admissible blocks a decode gives a new lease of `num_tokens` KV tokens that may
    generate `max_new_tokens` more: its blocks now and its headroom (the decode's rule)."""
    return num_blocks_for(num_tokens + min(RESERVE_TOKENS, max_new_tokens), max(1, block_size))


@dataclass(frozen=True)
class Pair:
    """A prefill and a decode that can serve one attempt together.

    Attributes:
        prefill_reason: Why this prefill (its cached prefix, or its load).
        num_matched_blocks: Leading full blocks of the prompt the prefill is believed to hold.
        booked: The work the pick booked on each instance's estimated load and has not yet
            settled (`Router.settle`), by role: prompt tokens on the prefill, blocks on the
            decode.
    """

    prefill: InstanceInfo
    decode: InstanceInfo
    prefill_reason: RouteReason = RouteReason.LOAD
    num_matched_blocks: int = 0
    booked: dict[InstanceRole, int] = field(default_factory=dict, compare=False, repr=False)

    def instance(self, role: InstanceRole) -> InstanceInfo:
        return self.prefill if role is InstanceRole.PREFILL else self.decode


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
class _Pool:
    """The routable instances of one role, model and KV layout, and their scores side by side
    (lower is better: queued prompt tokens of a prefill, minus the admissible blocks of a
    decode; both with what this gateway booked since the instance's last report)."""

    layout: KvLayout
    entries: list[InstanceEntry] = field(default_factory=list)
    scores: list[int] = field(default_factory=list)
    positions: dict[str, int] = field(default_factory=dict)

    def least(self) -> int:
        return min(self.scores)

    def positions_scoring(self, score: int) -> list[int]:
        """Where `score` stands in `scores`, found in C (`list.index`)."""
        found: list[int] = []
        with contextlib.suppress(ValueError):
            while True:
                found.append(self.scores.index(score, found[-1] + 1 if found else 0))
        return found


@dataclass(frozen=True)
class _Choice:
    """A pick before it is booked: each instance as its pool and position there."""

    prefill_pool: _Pool
    prefill_at: int
    decode_pool: _Pool
    decode_at: int
    reason: RouteReason
    num_matched_blocks: int

    @property
    def prefill(self) -> InstanceEntry:
        return self.prefill_pool.entries[self.prefill_at]

    @property
    def decode(self) -> InstanceEntry:
        return self.decode_pool.entries[self.decode_at]


class Router:
    """Cache- and load-aware pair selection over a `Registry`.

    Args:
        registry: Source of instances and their load.
        retry_after_s: Retry delay attached to NO_HEALTHY_INSTANCES.
        rng: Random source for tie-breaking (seed it in tests).
        cache_routing: Settings of the prefix preference (on, with defaults, when None).
    """

    def __init__(
        self,
        registry: Registry,
        retry_after_s: float = 1.0,
        rng: random.Random | None = None,
        cache_routing: CacheRouting | None = None,
    ) -> None:
        self._registry = registry
        self._retry_after_s = retry_after_s
        self._rng = rng or random.Random()
        self._cache_routing = cache_routing or CacheRouting()
        self.prefix_memory = PrefixMemory(self._cache_routing.memory_blocks)
        # NOTE: an instance that (re)joins may have restarted with an empty cache.
        registry.add_listener(lambda entry: self.prefix_memory.forget(entry.instance_id))
        registry.add_load_listener(self._rescore)
        # NOTE: work this gateway routed to an instance since its last load report, keyed by
        # instance id: (load_seq it applies to, prompt tokens for prefill / blocks for decode).
        self._pending: dict[str, tuple[int, int]] = {}
        # NOTE: instances that refused work for want of room: id -> the load_seq it applies to.
        self._full: dict[str, int] = {}
        # NOTE: {(role, model): {KV layout fingerprint: pool}}, valid for one registry version.
        self._pools: dict[tuple[InstanceRole, str], dict[str, _Pool]] = {}
        self._pools_version = -1

    def candidates(self, role: InstanceRole, model_name: str) -> list[InstanceEntry]:
        """Alive, non-draining, compatible instances of `role` serving `model_name`."""
        return [
            entry
            for entry in self._registry.alive(role, model_name)
            if not entry.load.is_draining and is_compatible(entry)
        ]

    def has_pair(self, model_name: str) -> bool:
        """Whether any compatible pair serves `model_name` right now."""
        decode_prints = {
            e.info.kv_layout.fingerprint for e in self.candidates(InstanceRole.DECODE, model_name)
        }
        return any(
            e.info.kv_layout.fingerprint in decode_prints
            for e in self.candidates(InstanceRole.PREFILL, model_name)
        )

    def pick(
        self,
        model_name: str,
        token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        exclude_prefill_ids: Collection[str] = (),
        exclude_decode_ids: Collection[str] = (),
        prompt_keys: PromptKeys | None = None,
        require_room: bool = False,
    ) -> Pair:
        """Chooses a pair and books the work on both instances' estimated load.

        Args:
            model_name: Served model name.
            token_ids: The tokens the prefill will take (prompt, plus generated tokens when a
                request is rescheduled).
            max_new_tokens: Tokens the decode may still generate (sizes its block estimate).
            exclude_prefill_ids: Prefills not to use.
            exclude_decode_ids: Decodes not to use.
            prompt_keys: The block keys of `token_ids`, when the caller keeps them across
                attempts (computed here when None).
            require_room: Pick only a decode whose estimated admissible blocks hold the
                request's lease (`lease_blocks`) and instances not marked full; a decode that
                reports no pool (``num_total_blocks`` 0) is taken at its word.

        Raises:
            PdserveError: NO_HEALTHY_INSTANCES (with a retry delay) when no pair qualifies;
                with `require_room`, DECODE_CAPACITY_EXHAUSTED or PREFILL_OVERLOADED when
                pairs exist but none has room now (the caller waits for room: see
                `pdserve.gateway.capacity_queue`).
        """
        keys = prompt_keys or PromptKeys(token_ids)
        num_tokens = len(token_ids)
        short: ErrorReason | None = None
        for _ in range(2):
            room = (num_tokens, max_new_tokens) if require_room else None
            prefills = self._pools_for(InstanceRole.PREFILL, model_name)
            decodes = self._pools_for(InstanceRole.DECODE, model_name)
            if exclude_prefill_ids or exclude_decode_ids:
                with (
                    _excluding(prefills, exclude_prefill_ids),
                    _excluding(decodes, exclude_decode_ids),
                ):
                    choice = self._choose(prefills, decodes, keys, room)
            else:
                choice = self._choose(prefills, decodes, keys, room)
            if isinstance(choice, ErrorReason):
                short = choice
                break
            if choice is None:
                break
            if self._is_routable(choice.prefill) and self._is_routable(choice.decode):
                return self._commit(choice, keys, num_tokens, max_new_tokens)
            # NOTE: one of them went silent since the registry last changed: rebuild, which
            # leaves out whatever is not alive now.
            self._pools_version = -1
        if short is ErrorReason.PROMPT_TOO_LONG:
            raise PdserveError(
                short,
                f"the request needs more KV blocks ({len(token_ids)} tokens + headroom) than "
                f"any decode of model {model_name!r} has in all",
                {"model": model_name},
            )
        if short is not None:
            what = "prefill has" if short is ErrorReason.PREFILL_OVERLOADED else "decode has"
            raise PdserveError(
                short,
                f"no {what} room for this request now (model {model_name!r})",
                {"model": model_name},
                retry_delay_s=self._retry_after_s,
            )
        raise PdserveError(
            ErrorReason.NO_HEALTHY_INSTANCES,
            f"no healthy, compatible prefill/decode pair serves model {model_name!r}",
            {"model": model_name},
            retry_delay_s=self._retry_after_s,
        )

    def _choose(
        self,
        prefills: dict[str, _Pool],
        decodes: dict[str, _Pool],
        keys: PromptKeys,
        room: tuple[int, int] | None = None,
    ) -> _Choice | ErrorReason | None:
        """The pair among what is not excluded; None when no pair is left. With `room`
        (tokens, max new tokens): only pairs with room for it, else the reason of the role
        that has none (DECODE_CAPACITY_EXHAUSTED or PREFILL_OVERLOADED)."""
        # NOTE: each pool's least score once per pick: a `min` over hundreds of scores costs
        # microseconds.
        usable: list[tuple[_Pool, int]] = []
        decode_least: dict[str, int] = {}
        short: ErrorReason | None = None
        for fingerprint, pool in prefills.items():
            decode_pool = decodes.get(fingerprint)
            if decode_pool is None:
                continue
            least, decode_least[fingerprint] = pool.least(), decode_pool.least()
            if least >= _EXCLUDED or decode_least[fingerprint] >= _EXCLUDED:
                continue
            if room is not None and least == _FULL:
                short = ErrorReason.PREFILL_OVERLOADED
            elif room is not None and not _has_room(decode_pool, decode_least[fingerprint], room):
                if _could_ever_hold(decode_pool, room):
                    short = ErrorReason.DECODE_CAPACITY_EXHAUSTED
                elif short is None:
                    short = ErrorReason.PROMPT_TOO_LONG
            else:
                usable.append((pool, least))
        if not usable:
            return short
        prefill_pool, prefill_at, reason, num_matched_blocks = self._choose_prefill(usable, keys)
        fingerprint = prefill_pool.layout.fingerprint
        decode_pool = decodes[fingerprint]
        decode_at = self._rng.choice(decode_pool.positions_scoring(decode_least[fingerprint]))
        return _Choice(prefill_pool, prefill_at, decode_pool, decode_at, reason, num_matched_blocks)

    def _choose_prefill(
        self, usable: list[tuple[_Pool, int]], keys: PromptKeys
    ) -> tuple[_Pool, int, RouteReason, int]:
        """The rule of `pdserve.gateway.routing_policy`: among prefills within the balance
        of the least loaded, the longest cached prefix (then the fewest queued tokens); else
        the fewest queued tokens. Equally good ones at random. `usable` pairs each pool
        with its least score."""
        least = min(pool_least for _, pool_least in usable)
        if self._cache_routing.is_enabled:
            within = min(least + self._cache_routing.balance_tokens, _FULL - 1)
            best: tuple[int, int] = (1, -_EXCLUDED)  # (matched blocks, -score): higher wins
            ties: list[tuple[_Pool, int]] = []
            memory = self.prefix_memory
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
                pool, at = self._rng.choice(ties)
                return pool, at, RouteReason.PREFIX, best[0]
        least_loaded = [
            (pool, at)
            for pool, pool_least in usable
            if pool_least == least
            for at in pool.positions_scoring(least)
        ]
        pool, at = self._rng.choice(least_loaded)
        return pool, at, RouteReason.LOAD, 0

    def _commit(
        self, choice: _Choice, keys: PromptKeys, num_tokens: int, max_new_tokens: int
    ) -> Pair:
        """Books the work on both, remembers the prompt's blocks on the prefill."""
        prefill, layout = choice.prefill, choice.prefill_pool.layout
        if self._cache_routing.is_enabled:
            max_blocks = prefill.load.num_total_blocks or None
            self.prefix_memory.record(prefill.instance_id, keys.of(layout), max_blocks)
        num_uncached_tokens = num_tokens - choice.num_matched_blocks * layout.block_size
        self._book(choice.prefill_pool, choice.prefill_at, num_uncached_tokens)
        num_blocks = lease_blocks(num_tokens, max_new_tokens, choice.decode_pool.layout.block_size)
        self._book(choice.decode_pool, choice.decode_at, num_blocks)
        booked = {InstanceRole.PREFILL: num_uncached_tokens, InstanceRole.DECODE: num_blocks}
        return Pair(
            prefill.info, choice.decode.info, choice.reason, choice.num_matched_blocks, booked
        )

    def settle(self, pair: Pair, role: InstanceRole, *, has_run: bool = True) -> None:
        """The attempt on `pair` is done with its `role` instance (the prefill computed the
        prompt, or the attempt ended there): the work its pick booked there leaves that
        instance's estimated load, until the next report (which no longer counts it).
        Settling a role twice, or an unbooked pair, does nothing.

        `has_run`: the work ran there (the prefill computed it, the decode held its lease),
        so its end freed room: an instance marked full (`mark_full`) takes work again. An
        attempt refused there frees none."""
        amount = pair.booked.pop(role, None)
        entry = self._registry.get(pair.instance(role).instance_id)
        if amount is None or entry is None:
            return
        self._pending[entry.instance_id] = (entry.load_seq, self._pending_for(entry) - amount)
        if has_run:
            self._full.pop(entry.instance_id, None)
        self._rescore(entry)

    def mark_full(self, instance_id: str) -> None:
        """The instance refused a request for want of room (a decode's blocks, a prefill's
        queue) although its estimate showed some: it takes no work under `require_room`
        until its next load report, or until work this gateway sent there ends."""
        entry = self._registry.get(instance_id)
        if entry is not None:
            self._full[instance_id] = entry.load_seq
            self._rescore(entry)

    # ---- the candidate pools ---------------------------------------------------------------

    def _pools_for(self, role: InstanceRole, model_name: str) -> dict[str, _Pool]:
        """The pools of `role` and `model_name` by KV fingerprint, rebuilt after the
        registry changed."""
        if self._pools_version != self._registry.version:
            self._pools.clear()
            self._pools_version = self._registry.version
            if self._cache_routing.is_enabled:
                self.prefix_memory.retain({e.instance_id for e in self._registry.entries()})
        pools = self._pools.get((role, model_name))
        if pools is None:
            pools = {}
            for entry in self.candidates(role, model_name):
                layout = entry.info.kv_layout
                pool = pools.setdefault(layout.fingerprint, _Pool(layout))
                pool.positions[entry.instance_id] = len(pool.entries)
                pool.entries.append(entry)
                pool.scores.append(self._score(entry))
            self._pools[role, model_name] = pools
        return pools

    def _is_routable(self, entry: InstanceEntry) -> bool:
        return self._registry.is_alive(entry) and not entry.load.is_draining

    def _score(self, entry: InstanceEntry) -> int:
        if self._full.get(entry.instance_id, -1) == entry.load_seq:
            return _FULL
        if entry.info.role is InstanceRole.PREFILL:
            # NOTE: work settled since the report may include some the report already left
            # out (it ended just before the report): never below an idle prefill.
            return max(0, entry.load.num_queued_prompt_tokens + self._pending_for(entry))
        return self._pending_for(entry) - entry.load.num_admissible_blocks

    def _rescore(self, entry: InstanceEntry) -> None:
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

    def _pending_for(self, entry: InstanceEntry) -> int:
        seq, amount = self._pending.get(entry.instance_id, (entry.load_seq, 0))
        return amount if seq == entry.load_seq else 0

    def _book(self, pool: _Pool, at: int, amount: int) -> None:
        entry = pool.entries[at]
        self._pending[entry.instance_id] = (entry.load_seq, self._pending_for(entry) + amount)
        pool.scores[at] = self._score(entry)


def _has_room(pool: _Pool, least: int, room: tuple[int, int]) -> bool:
    """Whether the best decode of `pool` (score `least`) has room for a lease of `room`
    (tokens, max new tokens); a decode that reports no pool is taken at its word."""
    num_tokens, max_new_tokens = room
    if least == _FULL:
        return False
    if -least >= lease_blocks(num_tokens, max_new_tokens, pool.layout.block_size):
        return True
    return any(pool.entries[at].load.num_total_blocks == 0 for at in pool.positions_scoring(least))


def _could_ever_hold(pool: _Pool, room: tuple[int, int]) -> bool:
    """Whether some decode of `pool` could hold a lease of `room` once it is idle."""
    num_blocks = lease_blocks(*room, pool.layout.block_size)
    return any(
        entry.load.num_total_blocks == 0 or entry.load.num_total_blocks >= num_blocks
        for entry in pool.entries
    )


@contextlib.contextmanager
def _excluding(pools: dict[str, _Pool], instance_ids: Collection[str]) -> Iterator[None]:
    """Scores the instances of `instance_ids` out of reach for one pick."""
    saved = []
    for instance_id in instance_ids:
        for pool in pools.values():
            at = pool.positions.get(instance_id)
            if at is not None:
                saved.append((pool, at, pool.scores[at]))
                pool.scores[at] = _EXCLUDED
    try:
        yield
    finally:
        for pool, at, score in saved:
            pool.scores[at] = score


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
