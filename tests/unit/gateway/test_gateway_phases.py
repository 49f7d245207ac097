"""Where the time to first token goes: the gateway's arithmetic, the wire format, and which
attempt's phases count when attempts fail."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram
from support.memory_backend import lose
from support.memory_cluster import MemoryCluster, expected

from pdserve.gateway.fleet.backend import FirstTokenEvent, HandedOffEvent, PrefillPhases
from pdserve.gateway.fleet.convert import prefill_event_from_pb
from pdserve.gateway.phases import TtftTimeline
from pdserve.v1 import prefill_pb2

REPORTED = PrefillPhases(lease_s=0.25, queue_s=0.5, compute_s=1.0)
HANDED_OFF = PrefillPhases(0.25, 0.5, 1.0, transfer_tail_s=0.125, transport="grpc")

# (timeline, expected durations by phase)
CASES = [
    pytest.param(TtftTimeline(arrival=10.0), {}, id="nothing-yet"),
    pytest.param(
        TtftTimeline(
            arrival=10.0,
            prefill_dispatched=10.5,
            first_token_received=12.5,
            first_token_written=12.75,
            prefill=REPORTED,
            transfer_tail_s=0.125,
            transport="grpc",
        ),
        {
            "admission_queue": 0.0,
            "gateway_queue": 0.5,
            "network": 0.25,  # 2.0 s round trip, 1.75 s of it inside the prefill
            "lease": 0.25,
            "prefill_queue": 0.5,
            "compute": 1.0,
            "first_token_to_client": 0.25,
            "transfer_tail": 0.125,
        },
        id="every-phase",
    ),
    pytest.param(
        TtftTimeline(
            arrival=10.0,
            prefill_dispatched=10.5,
            first_token_received=12.5,
            first_token_written=12.75,
        ),
        {"admission_queue": 0.0, "gateway_queue": 0.5, "first_token_to_client": 0.25},
        id="older-prefill-reports-no-phases",
    ),
    pytest.param(
        TtftTimeline(
            arrival=10.0, prefill_dispatched=10.5, first_token_received=11.0, prefill=REPORTED
        ),
        {
            "admission_queue": 0.0,
            "gateway_queue": 0.5,
            "network": 0.0,
            "lease": 0.25,
            "prefill_queue": 0.5,
            "compute": 1.0,
        },
        id="network-is-never-negative",
    ),
    pytest.param(
        TtftTimeline(
            arrival=10.0, prefill_dispatched=12.5, first_token_received=13.0, queue_wait_s=2.0
        ),
        {"admission_queue": 2.0, "gateway_queue": 0.5},
        id="time-in-the-admission-queue-is-its-own-phase",
    ),
]


@pytest.mark.parametrize(("timeline", "expected_phases"), CASES)
def test_durations(timeline: TtftTimeline, expected_phases: dict[str, float]) -> None:
    assert timeline.durations() == pytest.approx(expected_phases)


def test_record_observes_each_phase_once() -> None:
    registry = CollectorRegistry()
    histogram = Histogram("phase_seconds", "test", ["phase"], registry=registry)
    timeline = TtftTimeline(arrival=1.0, prefill_dispatched=1.5)

    class Span:
        def __init__(self) -> None:
            self.attributes: dict[str, object] = {}

        def set_attribute(self, key: str, value: object) -> None:
            self.attributes[key] = value

    span = Span()
    timeline.record(histogram, span)  # type: ignore[arg-type]
    assert registry.get_sample_value("phase_seconds_count", {"phase": "gateway_queue"}) == 1
    assert registry.get_sample_value("phase_seconds_count", {"phase": "compute"}) is None
    assert span.attributes == {
        "pdserve.phase.admission_queue_ms": 0.0,
        "pdserve.phase.gateway_queue_ms": 500.0,
    }


def test_phases_from_the_wire() -> None:
    phases = prefill_pb2.PrefillPhases(
        lease_us=250_000, queue_us=500_000, compute_us=10**6, transfer_tail_us=125_000,
        transport="grpc",
    )  # fmt: skip
    first = prefill_event_from_pb(
        prefill_pb2.PrefillResponse(first_token=prefill_pb2.FirstToken(token_id=3, phases=phases))
    )
    assert first == FirstTokenEvent(3, 0, PrefillPhases(0.25, 0.5, 1.0, None, "grpc"))
    handed_off = prefill_event_from_pb(
        prefill_pb2.PrefillResponse(handed_off=prefill_pb2.HandedOff(lease_id="l", phases=phases))
    )
    assert handed_off == HandedOffEvent("l", "", HANDED_OFF)
    # A prefill older than contract 1.4 sends no phases.
    old = prefill_event_from_pb(
        prefill_pb2.PrefillResponse(first_token=prefill_pb2.FirstToken(token_id=3))
    )
    assert old == FirstTokenEvent(3, 0, None)


async def test_the_attempt_that_delivered_the_first_token_reports_the_phases() -> None:
    cluster = MemoryCluster()
    cluster.add_prefill().phases = HANDED_OFF
    cluster.add_decode()
    timeline = TtftTimeline()
    request = cluster.request()
    assert (await cluster.run(request, timeline=timeline)).token_ids == expected(request)
    phases = timeline.durations()
    assert timeline.prefill == REPORTED
    assert set(phases) == {
        "admission_queue", "gateway_queue", "network", "lease", "prefill_queue", "compute",
        "transfer_tail",
    }  # fmt: skip
    assert phases["transfer_tail"] == 0.125 and timeline.transport == "grpc"


async def test_a_retry_after_the_first_token_reports_no_transfer_tail() -> None:
    cluster = MemoryCluster()
    doomed = cluster.add_prefill("prefill-doomed")
    doomed.phases = HANDED_OFF
    doomed.script = [lose(after=1)]  # after the first token, before the handoff
    other = cluster.add_prefill("prefill-other", num_queued_prompt_tokens=500)
    other.phases = PrefillPhases(9.0, 9.0, 9.0, transfer_tail_s=9.0, transport="tcp")
    cluster.add_decode()
    timeline = TtftTimeline()
    request = cluster.request()
    assert (await cluster.run(request, timeline=timeline)).token_ids == expected(request)
    assert len(other.calls) == 1
    # The first token came from the doomed prefill: its phases count, the other's do not.
    assert timeline.prefill == REPORTED
    assert "transfer_tail" not in timeline.durations() and timeline.transport == ""
