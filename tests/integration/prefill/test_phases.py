"""Where a prefill request's time goes: the phase arithmetic, then a real Prefill stream."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.prefill_cluster import Delay, cluster

from pdserve.common.generation import SamplingParams
from pdserve.prefill.convert import phases_to_proto
from pdserve.prefill.phases import PhaseClock, PhaseDurations
from pdserve.serving.transports import TRANSPORT_KINDS
from pdserve.v1 import decode_pb2, prefill_pb2

SHORT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

# (clock, expected durations)
CASES = [
    pytest.param(
        PhaseClock(arrival=10.0), PhaseDurations(), id="no-first-token-yet-reports-nothing"
    ),
    pytest.param(
        PhaseClock(arrival=10.0, lease_granted=10.5, first_scheduled=10.75, first_token=11.0),
        PhaseDurations(lease_s=0.5, queue_s=0.25, compute_s=0.25),
        id="first-token",
    ),
    pytest.param(
        PhaseClock(
            arrival=10.0,
            lease_granted=10.5,
            first_scheduled=10.75,
            first_token=11.0,
            handed_off=13.0,
        ),
        PhaseDurations(
            lease_s=0.5, queue_s=0.25, compute_s=0.25, transfer_tail_s=2.0, transport="grpc"
        ),
        id="handed-off",
    ),
    pytest.param(
        PhaseClock(arrival=10.0, first_scheduled=10.5, first_token=11.0),
        PhaseDurations(lease_s=0.0, queue_s=0.5, compute_s=0.5),
        id="no-lease-queue-starts-at-arrival",
    ),
    pytest.param(
        PhaseClock(arrival=10.0, lease_granted=10.5, first_token=11.0),
        PhaseDurations(lease_s=0.5, queue_s=0.5, compute_s=0.0),
        id="unscheduled-counts-as-queue",
    ),
    pytest.param(
        PhaseClock(arrival=10.0, lease_granted=10.5, first_scheduled=10.4, first_token=11.0),
        PhaseDurations(lease_s=0.5, queue_s=0.0, compute_s=0.6),
        id="clock-skew-is-never-negative",
    ),
]


@pytest.mark.parametrize(("clock", "expected"), CASES)
def test_durations(clock: PhaseClock, expected: PhaseDurations) -> None:
    durations = clock.durations("grpc")
    assert durations.transport == expected.transport
    for name in ("lease_s", "queue_s", "compute_s", "transfer_tail_s"):
        assert getattr(durations, name) == pytest.approx(getattr(expected, name)), name


def test_the_first_scheduled_pass_is_kept() -> None:
    clock = PhaseClock(arrival=1.0)
    clock.mark_scheduled(2.0)
    clock.mark_scheduled(3.0)
    assert clock.first_scheduled == 2.0


def test_after_first_token_keeps_only_the_tail() -> None:
    durations = PhaseDurations(0.1, 0.2, 0.3, 0.4, "grpc")
    assert durations.after_first_token().by_name() == {"transfer_tail": 0.4}
    assert PhaseDurations(0.1, 0.2, 0.3).by_name() == {"lease": 0.1, "queue": 0.2, "compute": 0.3}


def test_phases_to_proto_in_microseconds() -> None:
    message = phases_to_proto(PhaseDurations(0.0015, 0.25, 1.0, None, ""))
    assert message == prefill_pb2.PrefillPhases(lease_us=1500, queue_us=250_000, compute_us=10**6)


async def test_a_real_prefill_reports_its_phases(tiny_model_dir: Path) -> None:
    slow_lease = Delay("AllocateBlocks", 0.3)
    slow_commit = Delay("SyncCache", 1.0)
    # NOTE: over gRPC the decode's acknowledgement is the SyncCache call that `slow_commit`
    # holds (the other transports acknowledge over their own channel).
    interceptors = [[slow_lease, slow_commit]]
    async with cluster(
        tiny_model_dir, decode_interceptors=interceptors, kv_transports="grpc"
    ) as pd:
        sent = time.monotonic()
        events = await pd.run_prefill(pd.request("r", SHORT, GREEDY))
        assert events.error is None
        assert events.kinds == ["first_token", "handed_off"]
        first = events.messages[0].first_token
        handed_off = events.messages[1].handed_off
        assert first.HasField("phases") and handed_off.HasField("phases")
        assert first.phases.lease_us >= 250_000  # the decode held AllocateBlocks for 0.3 s
        assert first.phases.compute_us > 0
        assert first.phases.transfer_tail_us == 0 and first.phases.transport == ""
        # The handoff repeats the phases up to the first token and adds the transfer tail:
        # the decode held the stream for 1 s from the lease, most of it after the first token.
        for name in ("lease_us", "queue_us", "compute_us"):
            assert getattr(handed_off.phases, name) == getattr(first.phases, name)
        # NOTE: not a fixed share: on a busy machine compute eats more of the decode's 1 s
        phases = handed_off.phases
        assert phases.transfer_tail_us + phases.queue_us + phases.compute_us >= 950_000
        assert phases.transfer_tail_us > 0
        assert handed_off.phases.transport == "grpc"
        kind = decode_pb2.TransportKind.Value(handed_off.transport)  # the same, as an enum name
        assert TRANSPORT_KINDS[handed_off.phases.transport] == kind
        # The phases fit in what the caller waited for each message.
        to_first_s = (first.phases.lease_us + first.phases.queue_us + first.phases.compute_us) / 1e6
        assert to_first_s <= events.times[0] - sent
        assert to_first_s + handed_off.phases.transfer_tail_us / 1e6 <= events.times[1] - sent
        registry = pd.prefill.metrics.registry
        for phase in ("lease", "queue", "compute", "transfer_tail"):
            count = registry.get_sample_value(
                "pdserve_prefill_phase_seconds_count", {"phase": phase}
            )
            assert count == 1, phase
        lease_sum = registry.get_sample_value(
            "pdserve_prefill_phase_seconds_sum", {"phase": "lease"}
        )
        assert lease_sum == pytest.approx(first.phases.lease_us / 1e6, abs=1e-5)
        await pd.generate(handed_off.lease_id)  # the decode finishes the request
        await pd.assert_whole()
