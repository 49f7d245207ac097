"""The gateway's memory of prefill caches: longest leading match, bounded, forgetful."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.prefix_keys import prefix_block_keys
from pdserve.gateway.routing.prefix_memory import PrefixMemory


def _keys(*token_ids: int, block_size: int = 2) -> list[bytes]:
    return prefix_block_keys("layout", list(token_ids), block_size)


def test_matches_the_leading_blocks_only() -> None:
    memory = PrefixMemory(100)
    memory.record("p1", _keys(1, 2, 3, 4, 5, 6))
    assert memory.num_matched_blocks("p1", _keys(1, 2, 3, 4, 5, 6, 7, 8)) == 3
    assert memory.num_matched_blocks("p1", _keys(1, 2, 3, 9, 5, 6)) == 1
    assert memory.num_matched_blocks("p1", _keys(9, 2, 3, 4)) == 0
    assert memory.num_matched_blocks("p2", _keys(1, 2, 3, 4)) == 0


def test_is_bounded_per_instance_and_forgets_a_prefix_tail_first() -> None:
    memory = PrefixMemory(4)
    memory.record("p1", _keys(*range(12)))  # 6 blocks, bound 4: the head stays
    assert memory.num_blocks("p1") == 4
    assert memory.num_matched_blocks("p1", _keys(*range(12))) == 4
    memory.record("p1", _keys(50, 51, 52, 53))  # newer: evicts the old prefix's tail
    assert memory.num_matched_blocks("p1", _keys(*range(12))) == 2
    assert memory.num_matched_blocks("p1", _keys(50, 51, 52, 53)) == 2
    memory.record("p2", _keys(*range(12)), max_blocks=3)  # the prefill's pool is smaller
    assert memory.num_blocks("p2") == 3 and memory.num_blocks("p1") == 4


def test_a_repeated_prefix_stays_while_others_come_and_go() -> None:
    memory = PrefixMemory(6)
    for i in range(20):
        memory.record("p1", _keys(1, 2, 3, 4))  # the hot system prompt, refreshed
        memory.record("p1", _keys(100 + i, 0, 0, 0))
        memory.record("p1", _keys(200 + i, 0))
        assert memory.num_matched_blocks("p1", _keys(1, 2, 3, 4)) == 2
    assert memory.num_blocks("p1") == 6


def test_forgets_departed_instances() -> None:
    memory = PrefixMemory(10)
    memory.record("p1", _keys(1, 2))
    memory.record("p2", _keys(1, 2))
    memory.retain({"p2", "p3"})
    assert memory.instance_ids == {"p2"}
    memory.forget("p2")
    assert memory.num_matched_blocks("p2", _keys(1, 2)) == 0 and not memory.instance_ids


def test_refuses_a_bound_below_one() -> None:
    with pytest.raises(ValueError):
        PrefixMemory(0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["record", "record", "record", "forget"]),
            st.sampled_from(["p1", "p2", "p3"]),
            st.lists(st.integers(0, 3), min_size=0, max_size=12),
        ),
        max_size=30,
    ),
    st.lists(st.integers(0, 3), min_size=0, max_size=12),
)
def test_matches_agree_with_what_each_instance_holds(operations, prompt) -> None:
    # NOTE: few distinct tokens, a small bound: prefixes are shared, evicted and forgotten.
    memory = PrefixMemory(5)
    for operation, instance_id, token_ids in operations:
        if operation == "record":
            memory.record(instance_id, _keys(*token_ids))
        else:
            memory.forget(instance_id)
    keys = _keys(*prompt)
    expected = {i: _leading_held(memory, i, keys) for i in ("p1", "p2", "p3")}
    assert {i: memory.num_matched_blocks(i, keys) for i in expected} == expected
    assert memory.matches(keys) == {i: n for i, n in expected.items() if n > 0}


def _leading_held(memory: PrefixMemory, instance_id: str, keys: list[bytes]) -> int:
    """The definition, walked key by key (the memory searches, relying on prefixes)."""
    held = 0
    while held < len(keys) and memory.holds(instance_id, keys[held]):
        held += 1
    return held
