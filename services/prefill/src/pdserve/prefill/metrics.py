"""The prefill instance's Prometheus metrics (one registry per instance)."""

from __future__ import annotations

from pdserve.common.metrics import InstanceMetrics


class PrefillMetrics(InstanceMetrics):
    """Histograms observed by the engine thread and the handoffs.

    Attributes:
        pass_seconds: Duration of one prefill forward pass (all chunks of the batch).
        transfer_seconds: Duration of one request's KV push, first chunk to the decode's ack.
    """

    def __init__(self) -> None:
        super().__init__("prefill")
        self.pass_seconds = self.histogram(
            "pass_seconds", "Duration of one prefill forward pass over a batch of chunks."
        )
        self.transfer_seconds = self.histogram(
            "kv_transfer_seconds",
            "Duration of one request's KV push over SyncCache, open to acknowledged commit.",
        )
