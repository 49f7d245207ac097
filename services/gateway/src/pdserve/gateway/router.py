"""Picks a compatible prefill/decode pair for one attempt of a request.

Candidates are alive, not draining, speak our protocol major, serve the model, and are not
excluded by the caller (instances that already failed this request). A pair must share the KV
layout fingerprint. The prefill with the fewest queued prompt tokens wins, then the decode with
the most admissible blocks (free minus reserved headroom). Both loads include what this gateway
sent since the instance's last report, so a burst of requests between two heartbeats spreads
out instead of piling onto one instance. Ties are broken at random.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import num_blocks_for
from pdserve.common.protocol import check_compatible
from pdserve.gateway.instance import InstanceInfo, InstanceRole
from pdserve.gateway.registry import InstanceEntry, Registry


@dataclass(frozen=True)
class Pair:
    """A prefill and a decode that can serve one attempt together."""

    prefill: InstanceInfo
    decode: InstanceInfo


def is_compatible(entry: InstanceEntry) -> bool:
    """Same protocol major as the gateway (any minor)."""
    try:
        check_compatible(entry.info.protocol_version)
    except PdserveError:
        return False
    return True


class Router:
    """Load-aware pair selection over a `Registry`.

    Args:
        registry: Source of instances and their load.
        retry_after_s: Retry delay attached to NO_HEALTHY_INSTANCES.
        rng: Random source for tie-breaking (seed it in tests).
    """

    def __init__(
        self, registry: Registry, retry_after_s: float = 1.0, rng: random.Random | None = None
    ) -> None:
        self._registry = registry
        self._retry_after_s = retry_after_s
        self._rng = rng or random.Random()
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
        num_prompt_tokens: int,
        max_new_tokens: int,
        *,
        exclude_prefill_ids: Collection[str] = (),
        exclude_decode_ids: Collection[str] = (),
    ) -> Pair:
        """Chooses a pair and books the work on both instances' estimated load.

        Args:
            model_name: Served model name.
            num_prompt_tokens: Tokens the prefill will compute.
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
        prefill = self._best(prefills, lambda e: -self._queued_tokens(e))
        fingerprint = prefill.info.kv_layout.fingerprint
        decode = self._best(
            [e for e in decodes if e.info.kv_layout.fingerprint == fingerprint],
            self._admissible_blocks,
        )
        self._book(prefill, num_prompt_tokens)
        block_size = max(1, decode.info.kv_layout.block_size)
        self._book(decode, num_blocks_for(num_prompt_tokens + max_new_tokens, block_size))
        return Pair(prefill.info, decode.info)

    def _best(
        self, entries: list[InstanceEntry], score: Callable[[InstanceEntry], int]
    ) -> InstanceEntry:
        best_score = max(score(e) for e in entries)
        return self._rng.choice([e for e in entries if score(e) == best_score])

    def _pending_for(self, entry: InstanceEntry) -> int:
        seq, amount = self._pending.get(entry.instance_id, (entry.load_seq, 0))
        return amount if seq == entry.load_seq else 0

    def _book(self, entry: InstanceEntry, amount: int) -> None:
        self._pending[entry.instance_id] = (entry.load_seq, self._pending_for(entry) + amount)

    def _queued_tokens(self, entry: InstanceEntry) -> int:
        return entry.load.num_queued_prompt_tokens + self._pending_for(entry)

    def _admissible_blocks(self, entry: InstanceEntry) -> int:
        return entry.load.num_admissible_blocks - self._pending_for(entry)
