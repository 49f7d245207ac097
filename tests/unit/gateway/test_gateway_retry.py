"""Retry decisions by error reason (retry scope), never by message text."""

from __future__ import annotations

import pytest
from support.gateway_cluster import instance_info

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import SamplingParams
from pdserve.gateway.backend import BackendError
from pdserve.gateway.instance import InstanceRole, LoadReport
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.progress import CompletionProgress
from pdserve.gateway.registry import Registry
from pdserve.gateway.request import GenerationRequest
from pdserve.gateway.retry import AttemptFailed, RequestState, RetryHandler, RetryPolicy
from pdserve.gateway.router import Pair

REQUEST = GenerationRequest("r", "tiny", (1, 2), SamplingParams(seed=1, max_tokens=8))
PAIR = Pair(instance_info("p", InstanceRole.PREFILL), instance_info("d", InstanceRole.DECODE))


def _handler(max_attempts: int = 3) -> tuple[RetryHandler, Registry, GatewayMetrics]:
    registry, metrics = Registry(ttl_s=60.0), GatewayMetrics()
    registry.register(PAIR.prefill, LoadReport())
    registry.register(PAIR.decode, LoadReport())
    return (
        RetryHandler(RetryPolicy(max_attempts=max_attempts), registry, metrics),
        registry,
        metrics,
    )


def _failed(
    stage: str, reason: ErrorReason, *, is_from_server: bool = True, **meta: str
) -> AttemptFailed:
    return AttemptFailed(
        stage, BackendError(PdserveError(reason, "x", meta), is_from_server=is_from_server)
    )


@pytest.mark.parametrize(
    ("stage", "reason", "meta", "excluded_prefills", "excluded_decodes"),
    [
        ("prefill", ErrorReason.DECODE_CAPACITY_EXHAUSTED, {}, set(), {"d"}),
        ("prefill", ErrorReason.PREFILL_OVERLOADED, {}, {"p"}, set()),
        ("prefill", ErrorReason.INCOMPATIBLE_PEER, {}, {"p"}, {"d"}),
        ("prefill", ErrorReason.INSTANCE_DRAINING, {}, {"p"}, set()),
        ("prefill", ErrorReason.INSTANCE_DRAINING, {"instanceId": "d"}, set(), {"d"}),
        ("prefill", ErrorReason.PEER_UNAVAILABLE, {}, set(), {"d"}),
        ("decode", ErrorReason.LEASE_EXPIRED, {}, set(), set()),
        ("prefill", ErrorReason.CACHE_SYNC_FAILED, {}, set(), set()),
    ],
)
def test_scope_decides_which_instance_is_excluded(
    stage: str,
    reason: ErrorReason,
    meta: dict[str, str],
    excluded_prefills: set[str],
    excluded_decodes: set[str],
) -> None:
    handler, _, metrics = _handler()
    state = RequestState(CompletionProgress(REQUEST))
    handler.on_failure(REQUEST, PAIR, state, _failed(stage, reason, **meta))
    assert (state.excluded_prefill_ids, state.excluded_decode_ids) == (
        excluded_prefills,
        excluded_decodes,
    )
    assert metrics.count("retries", reason.name) == 1


@pytest.mark.parametrize(
    "reason", [ErrorReason.INVALID_REQUEST, ErrorReason.PROMPT_TOO_LONG, ErrorReason.CANCELLED]
)
def test_never_scope_ends_the_request(reason: ErrorReason) -> None:
    handler, _, _ = _handler()
    with pytest.raises(PdserveError) as raised:
        handler.on_failure(
            REQUEST, PAIR, RequestState(CompletionProgress(REQUEST)), _failed("prefill", reason)
        )
    assert raised.value.reason is reason


def test_internal_is_retried_once() -> None:
    handler, _, _ = _handler(max_attempts=5)
    state = RequestState(CompletionProgress(REQUEST))
    handler.on_failure(REQUEST, PAIR, state, _failed("decode", ErrorReason.INTERNAL))
    with pytest.raises(PdserveError):
        handler.on_failure(REQUEST, PAIR, state, _failed("decode", ErrorReason.INTERNAL))


def test_attempts_are_bounded() -> None:
    handler, _, _ = _handler(max_attempts=2)
    state = RequestState(CompletionProgress(REQUEST))
    handler.on_failure(REQUEST, PAIR, state, _failed("prefill", ErrorReason.LEASE_NOT_FOUND))
    with pytest.raises(PdserveError) as raised:
        handler.on_failure(REQUEST, PAIR, state, _failed("prefill", ErrorReason.LEASE_NOT_FOUND))
    assert raised.value.reason is ErrorReason.LEASE_NOT_FOUND


def test_lost_connections_mark_the_instance_and_reschedule_lost_decodes() -> None:
    handler, registry, metrics = _handler()
    state = RequestState(CompletionProgress(REQUEST))
    lost = ErrorReason.PEER_UNAVAILABLE
    handler.on_failure(REQUEST, PAIR, state, _failed("decode", lost, is_from_server=False))
    assert state.num_reschedules == 1 and state.num_failures == 0
    assert state.excluded_decode_ids == {"d"}
    assert metrics.count("reschedules", "decode_lost") == 1
    handler.on_failure(REQUEST, PAIR, state, _failed("prefill", lost, is_from_server=False))
    assert state.excluded_prefill_ids == {"p"} and state.num_failures == 1
    assert registry.alive() == []


def test_a_corrupt_transfer_prefers_another_pair_but_does_not_require_one() -> None:
    handler, _, _ = _handler()
    state = RequestState(CompletionProgress(REQUEST))
    handler.on_failure(REQUEST, PAIR, state, _failed("prefill", ErrorReason.CACHE_SYNC_FAILED))
    assert (state.excluded_prefill_ids, state.excluded_decode_ids) == (set(), set())
    assert state.exclusions() == [
        ({"p"}, {"d"}),  # another prefill and another decode, if there are
        (set(), {"d"}),
        ({"p"}, set()),
        (set(), set()),  # else the same pair again
    ]


def test_exclusions_always_keep_the_excluded_instances() -> None:
    state = RequestState(CompletionProgress(REQUEST))
    assert state.exclusions() == [(set(), set())]
    state.excluded_prefill_ids.add("p-dead")
    state.avoided_decode_ids.add("d-preempting")
    assert state.exclusions() == [({"p-dead"}, {"d-preempting"}), ({"p-dead"}, set())]
