"""The decode instance's Prometheus metrics (one registry per instance)."""

from __future__ import annotations

from pdserve.common.metrics import InstanceMetrics


class DecodeMetrics(InstanceMetrics):
    """Histograms observed by the decode thread and the servicer.

    Attributes:
        step_seconds: Duration of one batched decode step (forward + sampling).
        sync_seconds: Duration of one SyncCache transfer, header to commit.
    """

    def __init__(self) -> None:
        super().__init__("decode")
        self.step_seconds = self.histogram(
            "step_seconds", "Duration of one batched decode step (forward pass and sampling)."
        )
        self.sync_seconds = self.histogram(
            "kv_transfer_seconds",
            "Duration of one SyncCache transfer as received, header to verified commit.",
        )
