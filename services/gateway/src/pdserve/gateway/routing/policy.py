"""Which prefill serves a request: the cached prefix against the load, as a pure function.

A prefill keeps the full KV blocks of recent prompts (its prefix cache) and skips computing a
prompt's leading blocks it already holds. The router estimates, per prefill, how many leading
blocks of a prompt it holds (`pdserve.gateway.routing.prefix_memory`) and passes each
candidate's load and match here. The rule, in the spirit of sgl-router's cache-aware policy:

1. Candidates whose queued prompt tokens exceed the least-loaded one's by more than
   ``balance_tokens`` are not eligible for a cache preference (a hot prefix must not pile up
   on one prefill while another idles).
2. If an eligible candidate matches at least one full block, the eligible candidates with the
   longest match win (reason ``prefix``); among them, the fewest queued tokens.
3. Otherwise (no match, or cache-aware routing off) the fewest queued tokens win (reason
   ``load``), as without a cache.

Equally good candidates are all returned; the router picks one at random (fair ties).

`choose_prefill` states the rule over a plain list of candidates. The router applies the same
rule over its indexes (it never builds that list: at 500 instances it would cost more than
the whole decision), and `tests/unit/gateway/routing/test_gateway_router.py` checks that the two
agree on random states.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.common.config import check_ranges, setting


class RouteReason(enum.Enum):
    """Why a prefill was chosen (span attribute and metric label)."""

    PREFIX = "prefix"  # the longest cached prefix among prefills within the load balance
    LOAD = "load"  # the fewest queued prompt tokens


@dataclass(frozen=True)
class CacheRouting:
    """Settings of cache-aware prefill routing; each is a gateway flag (``--cache-aware-routing``,
    ``--cache-balance-tokens``, ``--cache-memory-blocks``), whose help text is the field's."""

    is_enabled: bool = setting(
        True,
        "send a prompt to the prefill believed to hold its longest prefix in its "
        "prefix cache (off: always the prefill with the fewest queued prompt tokens)",
    )
    balance_tokens: int = setting(
        2048,
        "a prefill holding a prompt's prefix is preferred unless its queued prompt "
        "tokens exceed the least-loaded prefill's by more than this",
        min=0,
    )
    memory_blocks: int = setting(
        65536,
        "block keys remembered per prefill for cache-aware routing (least recently "
        "routed forgotten first; at most the prefill's pool size)",
        min=1,
    )

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass(frozen=True)
class PrefillLoad:
    """One candidate prefill as the policy sees it.

    Attributes:
        num_queued_tokens: Prompt tokens queued there (its report plus what was sent since).
        num_matched_blocks: Leading full blocks of the prompt it is believed to hold.
    """

    instance_id: str
    num_queued_tokens: int
    num_matched_blocks: int = 0


class PrefillChoice(NamedTuple):
    """The equally good prefills for a request, and why."""

    instance_ids: tuple[str, ...]
    reason: RouteReason
    num_matched_blocks: int


def choose_prefill(candidates: Sequence[PrefillLoad], settings: CacheRouting) -> PrefillChoice:
    """Applies the module's rule to `candidates` (at least one).

    Raises:
        ValueError: If `candidates` is empty.
    """
    if not candidates:
        raise ValueError("choose_prefill needs at least one candidate")
    least = min(c.num_queued_tokens for c in candidates)
    if settings.is_enabled:
        eligible = [c for c in candidates if c.num_queued_tokens - least <= settings.balance_tokens]
        longest = max(c.num_matched_blocks for c in eligible)
        if longest >= 1:
            matching = [c for c in eligible if c.num_matched_blocks == longest]
            return PrefillChoice(_least_loaded(matching), RouteReason.PREFIX, longest)
    return PrefillChoice(_least_loaded(candidates), RouteReason.LOAD, 0)


def _least_loaded(candidates: Sequence[PrefillLoad]) -> tuple[str, ...]:
    least = min(c.num_queued_tokens for c in candidates)
    return tuple(c.instance_id for c in candidates if c.num_queued_tokens == least)
