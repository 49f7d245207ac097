"""The prefill choice as a table: cached prefix against load, thresholds, ties, off."""

from __future__ import annotations

import pytest

from pdserve.gateway.routing.policy import (
    CacheRouting,
    PrefillChoice,
    PrefillLoad,
    RouteReason,
    choose_prefill,
)

PREFIX, LOAD = RouteReason.PREFIX, RouteReason.LOAD
ON = CacheRouting(balance_tokens=1000)
OFF = CacheRouting(is_enabled=False, balance_tokens=1000)


def _loads(*rows: tuple[str, int, int]) -> list[PrefillLoad]:
    return [PrefillLoad(instance_id, queued, matched) for instance_id, queued, matched in rows]


# (case, candidates as (id, queued tokens, matched blocks), settings, expected choice)
TABLE = [
    ("no match anywhere: least loaded", [("a", 50, 0), ("b", 10, 0)], ON, (("b",), LOAD, 0)),
    ("a match beats a lighter load", [("a", 900, 3), ("b", 0, 0)], ON, (("a",), PREFIX, 3)),
    ("match just within balance", [("a", 1000, 1), ("b", 0, 0)], ON, (("a",), PREFIX, 1)),
    ("match just past balance", [("a", 1001, 5), ("b", 0, 0)], ON, (("b",), LOAD, 0)),
    (
        "the longest eligible match wins",
        [("a", 0, 2), ("b", 500, 6), ("c", 5000, 9)],
        ON,
        (("b",), PREFIX, 6),
    ),
    (
        "equal matches: the lighter one",
        [("a", 300, 4), ("b", 200, 4), ("c", 0, 0)],
        ON,
        (("b",), PREFIX, 4),
    ),
    (
        "equal matches, equal load: a tie",
        [("a", 7, 4), ("b", 0, 1), ("c", 7, 4)],
        ON,
        (("a", "c"), PREFIX, 4),
    ),
    ("equal load, no match: a tie", [("a", 5, 0), ("b", 5, 0)], ON, (("a", "b"), LOAD, 0)),
    ("off: a match is ignored", [("a", 900, 3), ("b", 0, 0)], OFF, (("b",), LOAD, 0)),
    (
        "balance 0: only the least loaded may win by prefix",
        [("a", 1, 9), ("b", 0, 2)],
        CacheRouting(balance_tokens=0),
        (("b",), PREFIX, 2),
    ),
    ("a single candidate", [("a", 10**6, 0)], ON, (("a",), LOAD, 0)),
]


@pytest.mark.parametrize(
    ("candidates", "settings", "expected"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_choose_prefill(
    candidates: list[tuple[str, int, int]],
    settings: CacheRouting,
    expected: tuple[tuple[str, ...], RouteReason, int],
) -> None:
    assert choose_prefill(_loads(*candidates), settings) == PrefillChoice(*expected)


def test_no_candidate_and_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        choose_prefill([], ON)
    with pytest.raises(ValueError, match="balance_tokens must be >= 0"):
        CacheRouting(balance_tokens=-1)
    with pytest.raises(ValueError, match="memory_blocks must be >= 1"):
        CacheRouting(memory_blocks=0)
