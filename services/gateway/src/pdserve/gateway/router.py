"""Picks a compatible prefill/decode pair for one attempt of a request.

Candidates are alive, not draining, speak our protocol major, serve the model, and are not
excluded by the caller (instances that already failed this request). A pair must share the KV
layout fingerprint. The prefill is chosen by `pdserve.gateway.routing_policy.choose_prefill`:
the one believed to hold the longest prefix of the prompt in its prefix cache
(`pdserve.gateway.prefix_memory`) unless it is much busier than the least-loaded one, else the
one with the fewest queued prompt tokens. The decode with the most admissible blocks (free minus
reserved headroom) follows. Both loads include what this gateway sent since the instance's last
report, so a burst of requests between two heartbeats spreads out instead of piling onto one
instance. Ties are broken at random.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import num_blocks_for
from pdserve.common.prefix_keys import BlockHash, prefix_block_keys
from pdserve.common.protocol import check_compatible
from pdserve.gateway.instance import InstanceInfo, InstanceRole
from pdserve.gateway.prefix_memory import PrefixMemory
from pdserve.gateway.registry import InstanceEntry, Registry
from pdserve.gateway.routing_policy import CacheRouting, PrefillLoad, RouteReason, choose_prefill


@dataclass(frozen=True)
class Pair:
    """A prefill and a decode that can serve one attempt together.

    Attributes:
        prefill_reason: Why this prefill (its cached prefix, or its load).
        num_matched_blocks: Leading full blocks of the prompt the prefill is believed to hold.
    """

    prefill: InstanceInfo
    decode: InstanceInfo
    prefill_reason: RouteReason = RouteReason.LOAD
    num_matched_blocks: int = 0


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
        # NOTE: work this gateway routed to an instance since its last load report, keyed by
        # instance id: (load_seq it applies to, prompt tokens for prefill / blocks for decode).
        self._pending: dict[str, tuple[int, int]] = {}

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
    ) -> Pair:
        """Chooses a pair and books the work on both instances' estimated load.

        Args:
            model_name: Served model name.
            token_ids: The tokens the prefill will take (prompt, plus generated tokens when a
                request is rescheduled).
            max_new_tokens: Tokens the decode may still generate (sizes its block estimate).
            exclude_prefill_ids: Prefills not to use.
            exclude_decode_ids: Decodes not to use.

        Raises:
            PdserveError: NO_HEALTHY_INSTANCES (with a retry delay) when no pair qualifies.
        """
        prefills = [
            e
            for e in self.candidates(InstanceRole.PREFILL, model_name)
            if e.instance_id not in exclude_prefill_ids
        ]
        decodes = [
            e
            for e in self.candidates(InstanceRole.DECODE, model_name)
            if e.instance_id not in exclude_decode_ids
        ]
        decode_prints = {e.info.kv_layout.fingerprint for e in decodes}
        prefills = [e for e in prefills if e.info.kv_layout.fingerprint in decode_prints]
        if not prefills:
            raise PdserveError(
                ErrorReason.NO_HEALTHY_INSTANCES,
                f"no healthy, compatible prefill/decode pair serves model {model_name!r}",
                {"model": model_name},
                retry_delay_s=self._retry_after_s,
            )
        prefill, reason, num_matched_blocks = self._choose_prefill(prefills, token_ids)
        fingerprint = prefill.info.kv_layout.fingerprint
        decode = self._best(
            [e for e in decodes if e.info.kv_layout.fingerprint == fingerprint],
            self._admissible_blocks,
        )
        num_tokens = len(token_ids)
        num_cached_tokens = num_matched_blocks * prefill.info.kv_layout.block_size
        self._book(prefill, num_tokens - num_cached_tokens)
        block_size = max(1, decode.info.kv_layout.block_size)
        self._book(decode, num_blocks_for(num_tokens + max_new_tokens, block_size))
        return Pair(prefill.info, decode.info, reason, num_matched_blocks)

    def _choose_prefill(
        self, prefills: list[InstanceEntry], token_ids: Sequence[int]
    ) -> tuple[InstanceEntry, RouteReason, int]:
        """The prefill by `choose_prefill`; remembers the prompt's blocks there."""
        is_enabled = self._cache_routing.is_enabled
        keys = _PromptKeys(token_ids)
        if is_enabled:
            self.prefix_memory.retain({e.instance_id for e in self._registry.entries()})
        loads = [
            PrefillLoad(
                e.instance_id,
                self._queued_tokens(e),
                self.prefix_memory.num_matched_blocks(e.instance_id, keys.reusable(e))
                if is_enabled
                else 0,
            )
            for e in prefills
        ]
        choice = choose_prefill(loads, self._cache_routing)
        prefill = self._by_id(prefills, choice.instance_ids)
        if is_enabled:
            max_blocks = prefill.load.num_total_blocks or None
            self.prefix_memory.record(prefill.instance_id, keys.of(prefill), max_blocks)
        return prefill, choice.reason, choice.num_matched_blocks

    def _by_id(self, entries: list[InstanceEntry], instance_ids: Sequence[str]) -> InstanceEntry:
        """One of `instance_ids` (at random: fair ties), as its entry."""
        chosen = self._rng.choice(instance_ids)
        return next(e for e in entries if e.instance_id == chosen)

    def _best(
        self, entries: list[InstanceEntry], score: Callable[[InstanceEntry], int]
    ) -> InstanceEntry:
        scores = [score(e) for e in entries]
        best_score = max(scores)
        return self._rng.choice(
            [e for e, s in zip(entries, scores, strict=True) if s == best_score]
        )

    def _pending_for(self, entry: InstanceEntry) -> int:
        seq, amount = self._pending.get(entry.instance_id, (entry.load_seq, 0))
        return amount if seq == entry.load_seq else 0

    def _book(self, entry: InstanceEntry, amount: int) -> None:
        self._pending[entry.instance_id] = (entry.load_seq, self._pending_for(entry) + amount)

    def _queued_tokens(self, entry: InstanceEntry) -> int:
        return entry.load.num_queued_prompt_tokens + self._pending_for(entry)

    def _admissible_blocks(self, entry: InstanceEntry) -> int:
        return entry.load.num_admissible_blocks - self._pending_for(entry)


class _PromptKeys:
    """A prompt's block keys per KV layout, computed once per pick."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self._token_ids = token_ids
        self._keys: dict[tuple[str, int], list[BlockHash]] = {}
        self._reusable: dict[tuple[str, int], list[BlockHash]] = {}

    def of(self, entry: InstanceEntry) -> list[BlockHash]:
        """The keys of every full block under `entry`'s layout."""
        layout = entry.info.kv_layout
        block_size = max(1, layout.block_size)
        cached = self._keys.get((layout.fingerprint, block_size))
        if cached is None:
            cached = prefix_block_keys(layout.fingerprint, self._token_ids, block_size)
            self._keys[layout.fingerprint, block_size] = cached
        return cached

    def reusable(self, entry: InstanceEntry) -> list[BlockHash]:
        """The keys of the blocks `entry` may take from its cache for this prompt."""
        # NOTE: a prefill always computes the last token: its logits give the first token.
        layout = entry.info.kv_layout
        block_size = max(1, layout.block_size)
        reusable = self._reusable.get((layout.fingerprint, block_size))
        if reusable is None:
            reusable = self.of(entry)[: (len(self._token_ids) - 1) // block_size]
            self._reusable[layout.fingerprint, block_size] = reusable
        return reusable
