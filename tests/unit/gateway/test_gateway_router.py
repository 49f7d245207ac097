"""Pair selection: load-aware, compatible only, fair on ties, honours exclusions."""

from __future__ import annotations

import collections
import dataclasses
import random

import pytest
from support.gateway_cluster import instance_info
from support.gateway_fakes import MODEL_NAME

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.instance import InstanceRole, LoadReport
from pdserve.gateway.registry import Registry
from pdserve.gateway.router import Router

P, D = InstanceRole.PREFILL, InstanceRole.DECODE


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
    pair = Router(registry).pick(MODEL_NAME, 8, 8)
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
    assert router.pick(MODEL_NAME, 4, 4).decode.instance_id == "d-ok"
    pair = router.pick(MODEL_NAME, 4, 4, exclude_prefill_ids={"p1"})
    assert pair.prefill.instance_id == "p2"
    with pytest.raises(PdserveError) as raised:
        router.pick(MODEL_NAME, 4, 4, exclude_decode_ids={"d-ok"})
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
    pair = router.pick(MODEL_NAME, 4, 4)  # p-a is idler but has no compatible decode
    assert (pair.prefill.instance_id, pair.decode.instance_id) == ("p-b", "d-b")
    assert router.has_pair(MODEL_NAME)
    registry.deregister("p-b")
    assert not router.has_pair(MODEL_NAME)
    with pytest.raises(PdserveError):
        router.pick(MODEL_NAME, 4, 4)


def test_incompatible_protocol_major_is_never_picked() -> None:
    registry = _registry(("p1", P, LoadReport()), ("d1", D, LoadReport(num_free_blocks=5)))
    entry = registry.get("d1")
    assert entry is not None
    entry.info = dataclasses.replace(entry.info, protocol_version="2.3")
    with pytest.raises(PdserveError):
        Router(registry).pick(MODEL_NAME, 4, 4)


def test_ties_are_spread_fairly() -> None:
    registry = _registry(
        ("p1", P, LoadReport()),
        ("p2", P, LoadReport()),
        ("d1", D, LoadReport(num_free_blocks=1000)),
        ("d2", D, LoadReport(num_free_blocks=1000)),
    )
    router = Router(registry, rng=random.Random(7))
    picks = [router.pick(MODEL_NAME, 16, 16) for _ in range(200)]
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
    assert router.pick(MODEL_NAME, 40, 40).decode.instance_id == "d1"  # books 20 blocks
    assert router.pick(MODEL_NAME, 4, 4).decode.instance_id == "d2"  # d1 now ~80
    registry.heartbeat("d1", LoadReport(num_free_blocks=100))  # the report includes its work
    registry.heartbeat("d2", LoadReport(num_free_blocks=90))
    assert router.pick(MODEL_NAME, 4, 4).decode.instance_id == "d1"
