"""Picks a compatible prefill/decode pair for one attempt of a request.

Candidates are alive, not draining, speak our protocol major, serve the model, and are not
excluded by the caller (instances that already failed this request). A pair must share the KV
layout fingerprint. The prefill is chosen by the rule of `pdserve.gateway.routing.policy`: the
one believed to hold the longest prefix of the prompt in its prefix cache
(`pdserve.gateway.routing.prefix_memory`) unless it is much busier than the least-loaded one,
else the one with the fewest queued prompt tokens. The decode with the most admissible blocks
(free minus reserved headroom) follows, unless the request is a completion of a prompt whose
other completions went to a decode that has room for what it does not share with them
(`pdserve.gateway.routing.share_affinity`): then that one, which holds the prompt's KV once
for all of them. Both loads are the instance's last report corrected by
what this gateway saw since: work it sent there is added (a burst of requests between two
heartbeats spreads out instead of piling onto one instance), work it saw end there is taken off
again (`Router.settle`: a prefill that finished its prompts since its report is not taken for
as busy as it reported). Ties are broken at random.

A decision does not scan the registry: the candidates of each role, model and KV layout are
kept with their scores in flat lists (`pdserve.gateway.routing.pools`), so the least-loaded one
is a `min` in C, and only the prefills that hold the prompt's first block are asked how much of
it they hold. The prompt's block keys (a SHA-256 chain) are computed once per attempt
(`PromptKeys`).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.fleet.registry import Registry
from pdserve.gateway.routing.pair import Pair
from pdserve.gateway.routing.policy import CacheRouting
from pdserve.gateway.routing.pool_choice import PoolChoice, choose_prefill_in_pools
from pdserve.gateway.routing.pools import (
    EXCLUDED,
    FULL,
    EstimatedLoads,
    Pool,
    could_ever_hold,
    excluding,
    has_room,
    lease_blocks,
)
from pdserve.gateway.routing.prefix_memory import PrefixMemory
from pdserve.gateway.routing.prompt_keys import PromptKeys
from pdserve.gateway.routing.share_affinity import Affine, ShareAffinity, affine_decode


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
        self._retry_after_s = retry_after_s
        self._rng = rng or random.Random()
        self._cache_routing = cache_routing or CacheRouting()
        self.prefix_memory = PrefixMemory(self._cache_routing.memory_blocks)
        self.share_affinity = ShareAffinity()
        # NOTE: an instance that (re)joins may have restarted with an empty cache.
        registry.add_listener(lambda entry: self.prefix_memory.forget(entry.instance_id))
        self.loads = EstimatedLoads(
            registry,
            self.prefix_memory.retain if self._cache_routing.is_enabled else lambda ids: None,
        )

    def has_pair(self, model_name: str) -> bool:
        """Whether any compatible pair serves `model_name` right now."""
        decode_prints = {
            e.info.kv_layout.fingerprint
            for e in self.loads.candidates(InstanceRole.DECODE, model_name)
        }
        return any(
            e.info.kv_layout.fingerprint in decode_prints
            for e in self.loads.candidates(InstanceRole.PREFILL, model_name)
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
        required_features: frozenset[str] = frozenset(),
        share_key: str = "",
        num_shared_tokens: int = 0,
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
            required_features: Contract features both instances must advertise (e.g.
                ``constraints`` for a constrained request: an older instance would ignore it).
            share_key: The request's share key: the decode its other completions went to is
                preferred while it has room for the blocks they do not share.
            num_shared_tokens: The prompt's length (tokens whose full blocks the completions
                share on one decode).

        Raises:
            PdserveError: NO_HEALTHY_INSTANCES (with a retry delay) when no pair qualifies;
                with `require_room`, DECODE_CAPACITY_EXHAUSTED or PREFILL_OVERLOADED when
                pairs exist but none has room now (the caller waits for room: see
                `pdserve.gateway.routing.queue`).
        """
        keys = prompt_keys or PromptKeys(token_ids)
        num_tokens = len(token_ids)
        short: ErrorReason | None = None
        affine = Affine(self.share_affinity.decode_of(share_key), num_shared_tokens)
        for _ in range(2):
            room = (num_tokens, max_new_tokens) if require_room else None
            prefills = self.loads.pools(InstanceRole.PREFILL, model_name)
            decodes = self.loads.pools(InstanceRole.DECODE, model_name)
            if required_features:
                exclude_prefill_ids = {
                    *exclude_prefill_ids,
                    *(i for pool in prefills.values() for i in pool.lacking(required_features)),
                }
                exclude_decode_ids = {
                    *exclude_decode_ids,
                    *(i for pool in decodes.values() for i in pool.lacking(required_features)),
                }
            if exclude_prefill_ids or exclude_decode_ids:
                with (
                    excluding(prefills, exclude_prefill_ids),
                    excluding(decodes, exclude_decode_ids),
                ):
                    choice = self._choose(prefills, decodes, keys, num_tokens, room, affine)
            else:
                choice = self._choose(prefills, decodes, keys, num_tokens, room, affine)
            if isinstance(choice, ErrorReason):
                short = choice
                break
            if choice is None:
                break
            if self.loads.is_routable(choice.prefill) and self.loads.is_routable(choice.decode):
                self.share_affinity.record(share_key, choice.decode.instance_id)
                return self._commit(choice, keys, num_tokens, max_new_tokens)
            # NOTE: one of them went silent since the registry last changed: rebuild, which
            # leaves out whatever is not alive now.
            self.loads.invalidate()
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
        needs = f" with {', '.join(sorted(required_features))}" if required_features else ""
        raise PdserveError(
            ErrorReason.NO_HEALTHY_INSTANCES,
            f"no healthy, compatible prefill/decode pair{needs} serves model {model_name!r}",
            {"model": model_name},
            retry_delay_s=self._retry_after_s,
        )

    def _choose(
        self,
        prefills: dict[str, Pool],
        decodes: dict[str, Pool],
        keys: PromptKeys,
        num_tokens: int = 0,
        room: tuple[int, int] | None = None,
        affine: Affine | None = None,
    ) -> PoolChoice | ErrorReason | None:
        """The pair among what is not excluded; None when no pair is left. With `room`
        (tokens, max new tokens): only pairs with room for it, else the reason of the role
        that has none (DECODE_CAPACITY_EXHAUSTED or PREFILL_OVERLOADED). The `affine` decode
        (where the request's other completions went) is taken where it qualifies."""
        # NOTE: each pool's least score once per pick: a `min` over hundreds of scores costs
        # microseconds.
        usable: list[tuple[Pool, int]] = []
        decode_least: dict[str, int] = {}
        affine_at: dict[str, tuple[int, int]] = {}
        short: ErrorReason | None = None
        for fingerprint, pool in prefills.items():
            decode_pool = decodes.get(fingerprint)
            if decode_pool is None:
                continue
            least, decode_least[fingerprint] = pool.least(), decode_pool.least()
            if least >= EXCLUDED or decode_least[fingerprint] >= EXCLUDED:
                continue
            at_shared = affine_decode(decode_pool, affine, num_tokens, room)
            if at_shared is not None:
                affine_at[fingerprint] = at_shared
            if room is not None and least == FULL:
                short = ErrorReason.PREFILL_OVERLOADED
            elif at_shared is not None:
                usable.append((pool, least))
            elif room is not None and not has_room(decode_pool, decode_least[fingerprint], room):
                if could_ever_hold(decode_pool, room):
                    short = ErrorReason.DECODE_CAPACITY_EXHAUSTED
                elif short is None:
                    short = ErrorReason.PROMPT_TOO_LONG
            else:
                usable.append((pool, least))
        if not usable:
            return short
        prefill_pool, prefill_at, reason, num_matched_blocks = choose_prefill_in_pools(
            usable, keys, self._cache_routing, self.prefix_memory, self._rng
        )
        fingerprint = prefill_pool.layout.fingerprint
        decode_pool = decodes[fingerprint]
        decode_at, num_shared_blocks = affine_at.get(fingerprint, (-1, 0))
        if decode_at < 0:
            decode_at = self._rng.choice(decode_pool.positions_scoring(decode_least[fingerprint]))
        return PoolChoice(
            prefill_pool,
            prefill_at,
            decode_pool,
            decode_at,
            reason,
            num_matched_blocks,
            num_shared_blocks,
        )

    def _commit(
        self, choice: PoolChoice, keys: PromptKeys, num_tokens: int, max_new_tokens: int
    ) -> Pair:
        """Books the work on both, remembers the prompt's blocks on the prefill."""
        prefill, layout = choice.prefill, choice.prefill_pool.layout
        # NOTE: a prefill that caches nothing (max_cached_blocks 0) is not remembered to; one
        # that reports no bound may cache its whole pool.
        max_cached = prefill.load.max_cached_blocks
        if self._cache_routing.is_enabled and max_cached != 0:
            max_blocks = max_cached or prefill.load.num_total_blocks or None
            self.prefix_memory.record(prefill.instance_id, keys.of(layout), max_blocks)
        num_uncached_tokens = num_tokens - choice.num_matched_blocks * layout.block_size
        self.loads.book(choice.prefill_pool, choice.prefill_at, num_uncached_tokens)
        num_blocks = lease_blocks(num_tokens, max_new_tokens, choice.decode_pool.layout.block_size)
        num_blocks -= choice.num_shared_blocks
        self.loads.book(choice.decode_pool, choice.decode_at, num_blocks)
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
        so its end freed room: an instance marked full (`EstimatedLoads.mark_full`) takes
        work again. An
        attempt refused there frees none."""
        amount = pair.booked.pop(role, None)
        if amount is not None:
            self.loads.settle(pair.instance(role).instance_id, amount, has_run=has_run)
