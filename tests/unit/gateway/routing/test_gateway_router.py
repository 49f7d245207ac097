"""Pair selection: cache- and load-aware, compatible only, fair on ties, honours exclusions."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.gateway_cluster import instance_info
from support.gateway_fakes import MODEL_NAME
from support.memory_cluster import MemoryCluster, expected

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.fleet.convert import load_from_pb
from pdserve.gateway.fleet.instance import InstanceRole, LoadReport
from pdserve.gateway.fleet.registry import Registry
from pdserve.gateway.routing.policy import CacheRouting, PrefillLoad, RouteReason, choose_prefill
from pdserve.gateway.routing.pools import lease_blocks
from pdserve.gateway.routing.prompt_keys import PromptKeys
from pdserve.gateway.routing.router import Router
from pdserve.gateway.routing.share_affinity import (
    ShareAffinity,
    choices_blocks,
    max_choice_tokens,
)
from pdserve.v1 import common_pb2

P, D = InstanceRole.PREFILL, InstanceRole.DECODE
_first_tokens = itertools.count(1000)


def _tokens(num_tokens: int) -> list[int]:
    """A prompt that shares no prefix with any other prompt of these tests."""
    return [next(_first_tokens), *range(num_tokens - 1)]


def _registry(*instances: tuple[str, InstanceRole, LoadReport]) -> Registry:
    registry = Registry(ttl_s=60.0)
    for instance_id, role, load in instances:
        registry.register(instance_info(instance_id, role), load)
    return registry


def test_prefers_short_prefill_queue_and_free_decode_blocks() -> None:
    registry = _registry(
        ("p-busy", P, LoadReport(num_queued_prompt_tokens=900)),
        ("p-idle", P, LoadReport(num_queued_prompt_tokens=10)),
        ("d-reserved", D, LoadReport(num_free_blocks=100, num_reserved_blocks=95)),
        ("d-roomy", D, LoadReport(num_free_blocks=60, num_reserved_blocks=0)),
    )
    pair = Router(registry).pick(MODEL_NAME, _tokens(8), 8)
    assert (pair.prefill.instance_id, pair.decode.instance_id) == ("p-idle", "d-roomy")


def test_skips_draining_unreachable_and_excluded_instances() -> None:
    registry = _registry(
        ("p1", P, LoadReport()),
        ("p2", P, LoadReport(num_queued_prompt_tokens=50)),
        ("d-draining", D, LoadReport(num_free_blocks=500, is_draining=True)),
        ("d-gone", D, LoadReport(num_free_blocks=400)),
        ("d-ok", D, LoadReport(num_free_blocks=10)),
    )
    registry.mark_unreachable("d-gone")
    router = Router(registry)
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d-ok"
    pair = router.pick(MODEL_NAME, _tokens(4), 4, exclude_prefill_ids={"p1"})
    assert pair.prefill.instance_id == "p2"
    with pytest.raises(PdserveError) as raised:
        router.pick(MODEL_NAME, _tokens(4), 4, exclude_decode_ids={"d-ok"})
    assert raised.value.reason is ErrorReason.NO_HEALTHY_INSTANCES
    assert raised.value.retry_delay_s == 1.0


def test_pairs_only_equal_kv_fingerprints() -> None:
    registry = Registry(ttl_s=60.0)
    registry.register(instance_info("p-a", P, model_id="weights-a"), LoadReport())
    registry.register(
        instance_info("p-b", P, model_id="weights-b"), LoadReport(num_queued_prompt_tokens=99)
    )
    registry.register(instance_info("d-b", D, model_id="weights-b"), LoadReport(num_free_blocks=9))
    router = Router(registry)
    pair = router.pick(MODEL_NAME, _tokens(4), 4)  # p-a is idler but has no compatible decode
    assert (pair.prefill.instance_id, pair.decode.instance_id) == ("p-b", "d-b")
    assert router.has_pair(MODEL_NAME)
    registry.deregister("p-b")
    assert not router.has_pair(MODEL_NAME)
    with pytest.raises(PdserveError):
        router.pick(MODEL_NAME, _tokens(4), 4)


def test_incompatible_protocol_major_is_never_picked() -> None:
    registry = _registry(("p1", P, LoadReport()), ("d1", D, LoadReport(num_free_blocks=5)))
    entry = registry.get("d1")
    assert entry is not None
    entry.info = dataclasses.replace(entry.info, protocol_version="2.3")
    with pytest.raises(PdserveError):
        Router(registry).pick(MODEL_NAME, _tokens(4), 4)


def test_ties_are_spread_fairly() -> None:
    registry = _registry(
        ("p1", P, LoadReport()),
        ("p2", P, LoadReport()),
        ("d1", D, LoadReport(num_free_blocks=1000)),
        ("d2", D, LoadReport(num_free_blocks=1000)),
    )
    router = Router(registry, rng=random.Random(7))
    picks = [router.pick(MODEL_NAME, _tokens(16), 16) for _ in range(200)]
    prefills = collections.Counter(p.prefill.instance_id for p in picks)
    decodes = collections.Counter(p.decode.instance_id for p in picks)
    assert min(prefills.values()) >= 90 and min(decodes.values()) >= 90


def test_routed_work_counts_until_the_next_load_report() -> None:
    registry = _registry(
        ("p1", P, LoadReport()),
        ("d1", D, LoadReport(num_free_blocks=100)),
        ("d2", D, LoadReport(num_free_blocks=90)),
    )
    router = Router(registry)
    assert router.pick(MODEL_NAME, _tokens(40), 40).decode.instance_id == "d1"  # books 20 blocks
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d2"  # d1 now ~80
    registry.heartbeat("d1", LoadReport(num_free_blocks=100))  # the report includes its work
    registry.heartbeat("d2", LoadReport(num_free_blocks=90))
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d1"


SHARED = list(range(500, 532))  # 8 full blocks of BLOCK_SIZE 4


def _two_prefills(**routing: Any) -> tuple[Registry, Router]:
    registry = _registry(
        ("p1", P, LoadReport(num_total_blocks=1000)),
        ("p2", P, LoadReport(num_total_blocks=1000)),
        ("d1", D, LoadReport(num_free_blocks=10_000)),
    )
    return registry, Router(registry, rng=random.Random(3), cache_routing=CacheRouting(**routing))


def test_prompts_sharing_a_prefix_follow_it_and_unrelated_ones_spread() -> None:
    _, router = _two_prefills()
    first = router.pick(MODEL_NAME, [*SHARED, 1, 2], 4)
    assert (first.prefill_reason, first.num_matched_blocks) == (RouteReason.LOAD, 0)
    followers = [router.pick(MODEL_NAME, [*SHARED, 7, i], 4) for i in range(6)]
    assert {p.prefill.instance_id for p in followers} == {first.prefill.instance_id}
    assert {(p.prefill_reason, p.num_matched_blocks) for p in followers} == {
        (RouteReason.PREFIX, 8)
    }
    # NOTE: the last token is always computed, so a prompt of exactly 8 blocks matches 7.
    assert router.pick(MODEL_NAME, SHARED, 4).num_matched_blocks == 7
    unrelated = collections.Counter(
        router.pick(MODEL_NAME, _tokens(40), 4).prefill.instance_id for _ in range(40)
    )
    assert min(unrelated.values()) >= 15


def test_a_busy_cache_holder_loses_the_prefix_to_an_idle_prefill() -> None:
    registry, router = _two_prefills(balance_tokens=100)
    holder = router.pick(MODEL_NAME, [*SHARED, 1], 4).prefill.instance_id
    other = "p2" if holder == "p1" else "p1"
    registry.heartbeat(holder, LoadReport(num_queued_prompt_tokens=101, num_total_blocks=1000))
    spill = router.pick(MODEL_NAME, [*SHARED, 2], 4)
    assert (spill.prefill.instance_id, spill.prefill_reason) == (other, RouteReason.LOAD)
    registry.heartbeat(holder, LoadReport(num_queued_prompt_tokens=100, num_total_blocks=1000))
    within = router.pick(MODEL_NAME, [*SHARED, 3], 4)  # both hold it now: the idler one wins
    assert (within.prefill.instance_id, within.prefill_reason) == (other, RouteReason.PREFIX)


def test_cache_aware_routing_off_routes_by_load_only() -> None:
    _, router = _two_prefills(is_enabled=False)
    picks = [router.pick(MODEL_NAME, [*SHARED, i], 4) for i in range(40)]
    assert {p.prefill_reason for p in picks} == {RouteReason.LOAD}
    assert min(collections.Counter(p.prefill.instance_id for p in picks).values()) >= 15
    assert not router.prefix_memory.instance_ids


def test_only_uncached_tokens_are_booked_on_the_prefill() -> None:
    _, router = _two_prefills()
    holder = router.pick(MODEL_NAME, [*SHARED, 1], 4).prefill.instance_id  # books 33 tokens
    # NOTE: each books 2 tokens (8 blocks cached); booking all 34 would pass the balance (2048).
    for i in range(70):
        assert router.pick(MODEL_NAME, [*SHARED, 2, i], 4).prefill.instance_id == holder


def test_the_memory_keeps_what_each_prefill_says_it_caches() -> None:
    registry, router = _two_prefills()
    registry.heartbeat("p1", LoadReport(num_total_blocks=1000, max_cached_blocks=3))
    registry.heartbeat("p2", LoadReport(num_total_blocks=1000, max_cached_blocks=0))
    picks = [router.pick(MODEL_NAME, [*SHARED, i], 4) for i in range(10)]
    # NOTE: p1 keeps the head of the prefix (its 3 most recent blocks); p2 caches nothing.
    assert router.prefix_memory.num_blocks("p1") == 3
    assert "p2" not in router.prefix_memory.instance_ids
    held = [p for p in picks[1:] if p.prefill_reason == RouteReason.PREFIX]
    assert held and {(p.prefill.instance_id, p.num_matched_blocks) for p in held} == {("p1", 3)}


def test_a_load_report_without_the_bound_reads_as_none_and_zero_as_zero() -> None:
    assert load_from_pb(common_pb2.LoadReport(num_total_blocks=9)).max_cached_blocks is None
    assert load_from_pb(common_pb2.LoadReport(max_cached_blocks=0)).max_cached_blocks == 0
    assert load_from_pb(common_pb2.LoadReport(max_cached_blocks=7)).max_cached_blocks == 7


def test_the_memory_forgets_prefills_that_leave_or_rejoin() -> None:
    registry, router = _two_prefills()
    holder = router.pick(MODEL_NAME, [*SHARED, 1], 4).prefill.instance_id
    assert router.prefix_memory.num_blocks(holder) == 8
    entry = registry.get(holder)
    assert entry is not None
    registry.deregister(holder)
    router.pick(MODEL_NAME, _tokens(3), 4)
    assert holder not in router.prefix_memory.instance_ids
    registry.register(entry.info, LoadReport(num_total_blocks=1000))
    others = {"p1", "p2"} - {holder}
    assert (
        router.pick(MODEL_NAME, [*SHARED, 1], 4, exclude_prefill_ids=others).num_matched_blocks == 0
    )
    assert router.prefix_memory.num_blocks(holder) == 8
    registry.register(dataclasses.replace(entry.info, address="moved.invalid:2"), LoadReport())
    assert holder not in router.prefix_memory.instance_ids  # it may have restarted empty


async def test_the_orchestrator_counts_routes_by_reason() -> None:
    cluster = MemoryCluster()
    prefills = [cluster.add_prefill("prefill-a"), cluster.add_prefill("prefill-b")]
    cluster.add_decode()
    for _ in range(4):  # PROMPT_IDS: 19 tokens, 4 full blocks
        request = cluster.request()
        assert (await cluster.run(request)).token_ids == expected(request)
    assert sorted(len(p.calls) for p in prefills) == [0, 4]
    assert cluster.metrics.count("routes", "load") == 1
    assert cluster.metrics.count("routes", "prefix") == 3
    assert b'pdserve_gateway_routes_total{reason="prefix"} 3.0' in cluster.metrics.render()


def test_the_candidate_lists_follow_the_registry() -> None:
    now = [0.0]
    registry = Registry(ttl_s=5.0, clock=lambda: now[0])
    registry.register(instance_info("p1", P), LoadReport())
    registry.register(instance_info("d1", D), LoadReport(num_free_blocks=10))
    router = Router(registry)
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d1"
    registry.register(instance_info("d2", D), LoadReport(num_free_blocks=500))  # joins
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d2"
    registry.heartbeat("d2", LoadReport(num_free_blocks=500, is_draining=True))  # drains
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d1"
    registry.heartbeat("d2", LoadReport(num_free_blocks=500))  # back
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d2"
    now[0] = 4.0
    registry.heartbeat("p1", LoadReport())
    registry.heartbeat("d1", LoadReport(num_free_blocks=10))
    now[0] = 6.0  # d2 is silent past the TTL, though nothing dropped it yet
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d1"
    registry.heartbeat("d2", LoadReport(num_free_blocks=500))  # heard from again
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d2"
    registry.mark_unreachable("d2")
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d1"
    registry.deregister("d1")
    with pytest.raises(PdserveError):
        router.pick(MODEL_NAME, _tokens(4), 4)


def test_an_exclusion_lasts_one_pick_and_keeps_the_booked_work() -> None:
    registry = _registry(
        ("p1", P, LoadReport()),
        ("d1", D, LoadReport(num_free_blocks=100)),
        ("d2", D, LoadReport(num_free_blocks=95)),
    )
    router = Router(registry)
    assert router.pick(MODEL_NAME, _tokens(40), 40).decode.instance_id == "d1"  # books 20
    pair = router.pick(MODEL_NAME, _tokens(4), 4, exclude_decode_ids={"d2"})
    assert pair.decode.instance_id == "d1"  # books 2 more: d1 at 78, d2 at 95
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d2"
    assert router.pick(MODEL_NAME, _tokens(4), 4).decode.instance_id == "d2"  # 93 > 78


@settings(max_examples=150, deadline=None)
@given(
    queued=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
    held=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6)), max_size=8),
    prompt_blocks=st.integers(1, 6),
    balance_tokens=st.sampled_from([0, 500, 2048]),
)
def test_the_router_applies_the_routing_policy(queued, held, prompt_blocks, balance_tokens):
    # NOTE: the router applies `choose_prefill` over its indexes; here both see one state.
    registry = Registry(ttl_s=60.0)
    prefill_ids = [f"p{i}" for i in range(len(queued))]
    for instance_id, tokens in zip(prefill_ids, queued, strict=True):
        load = LoadReport(num_queued_prompt_tokens=tokens, num_total_blocks=1000)
        registry.register(instance_info(instance_id, P), load)
    registry.register(instance_info("d1", D), LoadReport(num_free_blocks=10_000))
    settings_ = CacheRouting(balance_tokens=balance_tokens)
    router = Router(registry, cache_routing=settings_)
    prompt = [*SHARED[: 4 * prompt_blocks], 1]
    keys = PromptKeys(prompt)
    layout = registry.alive(P)[0].info.kv_layout
    for index, num_blocks in held:
        if index < len(prefill_ids):
            router.prefix_memory.record(prefill_ids[index], keys.of(layout)[:num_blocks])
    loads = [
        PrefillLoad(i, t, router.prefix_memory.num_matched_blocks(i, keys.reusable(layout)))
        for i, t in zip(prefill_ids, queued, strict=True)
    ]
    expected = choose_prefill(loads, settings_)
    pair = router.pick(MODEL_NAME, prompt, 4, prompt_keys=keys)
    assert pair.prefill.instance_id in expected.instance_ids
    assert (pair.prefill_reason, pair.num_matched_blocks) == (
        expected.reason,
        expected.num_matched_blocks,
    )


# ---- room (the admission queue's question) ----------------------------------------------------


def _room_router(num_blocks: int) -> tuple[Registry, Router]:
    load = LoadReport(num_free_blocks=num_blocks, num_total_blocks=num_blocks)
    registry = _registry(("p1", P, LoadReport()), ("d1", D, load))
    return registry, Router(registry, rng=random.Random(0))


def test_room_counts_the_leases_booked_since_the_report() -> None:
    need = lease_blocks(40, 8, 4)  # the fakes' blocks of 4 tokens
    registry, router = _room_router(2 * need)
    pairs = [router.pick(MODEL_NAME, _tokens(40), 8, require_room=True) for _ in range(2)]
    with pytest.raises(PdserveError) as no_room:
        router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    assert no_room.value.reason is ErrorReason.DECODE_CAPACITY_EXHAUSTED
    router.pick(MODEL_NAME, _tokens(40), 8)  # NOTE: without require_room it routes anyway
    router.settle(pairs[0], D)
    router.settle(pairs[1], D)  # their streams ended: room for one more (the third holds some)
    router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    with pytest.raises(PdserveError):
        router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    registry.heartbeat("d1", LoadReport(num_free_blocks=2 * need, num_total_blocks=2 * need))
    router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)  # the report is the truth


def test_an_instance_marked_full_takes_work_again_once_work_ran_there_or_it_reports() -> None:
    registry, router = _room_router(1000)
    refused = router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    ran = router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    router.loads.mark_full("d1")
    with pytest.raises(PdserveError) as no_room:
        router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    assert no_room.value.reason is ErrorReason.DECODE_CAPACITY_EXHAUSTED
    router.settle(refused, D, has_run=False)  # a refused attempt freed nothing
    with pytest.raises(PdserveError):
        router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    router.settle(ran, D)  # a stream there ended
    router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    router.loads.mark_full("p1")
    with pytest.raises(PdserveError) as full_prefill:
        router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    assert full_prefill.value.reason is ErrorReason.PREFILL_OVERLOADED
    registry.heartbeat("p1", LoadReport())
    router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)


def test_a_request_no_decode_could_ever_hold_is_too_long_not_a_wait() -> None:
    _, router = _room_router(lease_blocks(40, 8, 4) - 1)
    with pytest.raises(PdserveError) as raised:
        router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    assert raised.value.reason is ErrorReason.PROMPT_TOO_LONG


def test_a_constrained_request_goes_only_where_both_ends_apply_constraints() -> None:
    """An instance of an older minor ignores a constraint it does not know: it is left out."""
    registry = Registry(ttl_s=60.0)
    older = ("preemption-notice", "token-index", "sync-cache-grpc")
    registry.register(instance_info("p-old", P, protocol_version="1.5", features=older),
                      LoadReport())  # fmt: skip
    registry.register(instance_info("p-new", P), LoadReport(num_queued_prompt_tokens=500))
    registry.register(instance_info("d-old", D, protocol_version="1.5", features=older),
                      LoadReport(num_free_blocks=900))  # fmt: skip
    registry.register(instance_info("d-new", D), LoadReport(num_free_blocks=10))
    router, needs = Router(registry, rng=random.Random(0)), frozenset({"constraints"})
    for _ in range(5):
        pair = router.pick(MODEL_NAME, _tokens(8), 8, required_features=needs)
        assert (pair.prefill.instance_id, pair.decode.instance_id) == ("p-new", "d-new")
    free = router.pick(MODEL_NAME, _tokens(8), 8)  # the least loaded, as ever
    assert (free.prefill.instance_id, free.decode.instance_id) == ("p-old", "d-old")
    registry.deregister("p-new")
    with pytest.raises(PdserveError) as raised:
        router.pick(MODEL_NAME, _tokens(8), 8, required_features=needs)
    assert raised.value.reason is ErrorReason.NO_HEALTHY_INSTANCES
    assert "with constraints" in raised.value.message


# ---- completions of one prompt (share keys) -----------------------------------------------------


def _two_decodes(d1_blocks: int = 100, d2_blocks: int = 100) -> tuple[Registry, Router]:
    registry = _registry(
        ("p1", P, LoadReport()),
        ("d1", D, LoadReport(num_free_blocks=d1_blocks, num_total_blocks=d1_blocks)),
        ("d2", D, LoadReport(num_free_blocks=d2_blocks, num_total_blocks=d2_blocks)),
    )
    return registry, Router(registry, rng=random.Random(3))


def test_completions_of_one_prompt_follow_the_first_to_its_decode() -> None:
    _, router = _two_decodes()
    prompt = _tokens(40)
    share = {"share_key": "r:abc", "num_shared_tokens": 40}
    first = router.pick(MODEL_NAME, prompt, 8, require_room=True, **share)
    # The first booked blocks there: the other decode is now the less loaded one, yet the
    # siblings go where the prompt's blocks are, and book only their own blocks.
    others = [router.pick(MODEL_NAME, prompt, 8, require_room=True, **share) for _ in range(3)]
    assert {p.decode.instance_id for p in others} == {first.decode.instance_id}
    assert first.booked[D] == lease_blocks(40, 8, 4)
    assert [p.booked[D] for p in others] == [lease_blocks(40, 8, 4) - 40 // 4] * 3
    # Without a share key the same requests spread by load.
    spread = [router.pick(MODEL_NAME, _tokens(40), 8, require_room=True) for _ in range(4)]
    assert {p.decode.instance_id for p in spread} == {"d1", "d2"}


def test_a_sibling_goes_elsewhere_when_the_decode_is_excluded_full_or_gone() -> None:
    registry, router = _two_decodes()
    prompt = _tokens(40)
    share = {"share_key": "r:abc", "num_shared_tokens": 40}
    held = router.pick(MODEL_NAME, prompt, 8, **share).decode.instance_id
    other = "d2" if held == "d1" else "d1"
    pick = router.pick(MODEL_NAME, prompt, 8, exclude_decode_ids={held}, **share)
    assert pick.decode.instance_id == other and pick.booked[D] == lease_blocks(40, 8, 4)
    # The key now points at `other`; marking it full sends the next sibling back.
    router.loads.mark_full(other)
    assert router.pick(MODEL_NAME, prompt, 8, require_room=True, **share).decode.instance_id == (
        held
    )
    registry.deregister(held)
    router.loads.invalidate()
    registry.heartbeat(other, LoadReport(num_free_blocks=100, num_total_blocks=100))
    assert router.pick(MODEL_NAME, prompt, 8, **share).decode.instance_id == other


def test_a_sibling_fits_where_only_its_own_blocks_have_room() -> None:
    need = lease_blocks(40, 8, 4)
    own = need - 40 // 4
    registry, router = _two_decodes(d1_blocks=need + own, d2_blocks=0)
    registry.heartbeat("d2", LoadReport(num_free_blocks=0, num_total_blocks=need + own))
    share = {"share_key": "r:abc", "num_shared_tokens": 40}
    prompt = _tokens(40)
    assert router.pick(MODEL_NAME, prompt, 8, require_room=True, **share).decode.instance_id == (
        "d1"
    )
    # A separate request of the same size no longer fits anywhere; the sibling does.
    with pytest.raises(PdserveError) as no_room:
        router.pick(MODEL_NAME, _tokens(40), 8, require_room=True)
    assert no_room.value.reason is ErrorReason.DECODE_CAPACITY_EXHAUSTED
    pick = router.pick(MODEL_NAME, prompt, 8, require_room=True, **share)
    assert pick.decode.instance_id == "d1" and pick.booked[D] == own


def test_the_share_memory_forgets_the_least_recently_routed_key_first() -> None:
    affinity = ShareAffinity(max_keys=2)
    affinity.record("a", "d1")
    affinity.record("b", "d2")
    affinity.record("a", "d3")  # routed again: most recent, and moved
    affinity.record("c", "d1")
    assert (affinity.decode_of("a"), affinity.decode_of("b"), affinity.decode_of("c")) == (
        "d3",
        None,
        "d1",
    )
    affinity.record("", "d1")  # no key: nothing to remember
    assert len(affinity) == 2 and affinity.decode_of("") is None


@pytest.mark.parametrize(
    ("num_prompt_tokens", "max_tokens", "n", "blocks"),
    [(10, 6, 1, 4), (10, 6, 4, 2 + 4 * 2), (8, 8, 3, 2 + 3 * 2), (3, 1, 16, 16)],
)
def test_choices_blocks_hold_the_prompt_once_and_each_completion_apart(
    num_prompt_tokens: int, max_tokens: int, n: int, blocks: int
) -> None:
    assert choices_blocks(num_prompt_tokens, max_tokens, n, 4) == blocks


@given(
    num_prompt_tokens=st.integers(1, 400),
    n=st.integers(2, 16),
    num_total_blocks=st.integers(1, 300),
    block_size=st.sampled_from([1, 4, 16]),
)
def test_max_choice_tokens_is_the_most_that_fits(
    num_prompt_tokens: int, n: int, num_total_blocks: int, block_size: int
) -> None:
    fits = max_choice_tokens(num_prompt_tokens, n, num_total_blocks, block_size)
    if fits:
        assert choices_blocks(num_prompt_tokens, fits, n, block_size) <= num_total_blocks
    assert choices_blocks(num_prompt_tokens, fits + 1, n, block_size) > num_total_blocks
