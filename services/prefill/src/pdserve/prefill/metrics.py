"""The prefill instance's Prometheus metrics (one registry per instance)."""

from __future__ import annotations

from pdserve.common.metrics import InstanceMetrics


class PrefillMetrics(InstanceMetrics):
    """Histograms observed by the engine thread and the handoffs.

    Attributes:
        pass_seconds: Duration of one prefill forward pass (all chunks of the batch).
        transfer_seconds: Duration of one request's KV push, first chunk to the decode's ack,
            by ``transport`` (shm, tcp, grpc).
        phase_seconds: Where requests' time went, by ``phase`` (lease, queue, compute,
            transfer_tail; see `pdserve.prefill.phases`).
    """

    def __init__(self) -> None:
        super().__init__("prefill")
        self.pass_seconds = self.histogram(
            "pass_seconds", "Duration of one prefill forward pass over a batch of chunks."
        )
        self.transfer_seconds = self.histogram(
            "kv_transfer_seconds",
            "Duration of one request's KV push, open to acknowledged commit, by transport.",
            ["transport"],
        )
        self.phase_seconds = self.histogram(
            "phase_seconds",
            "Phases of a prefill request: lease (arrival to lease granted), queue (to its first "
            "scheduled chunk), compute (to its first token), transfer_tail (to the decode's ack).",
            ["phase"],
        )
