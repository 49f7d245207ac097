"""The decode instance's Prometheus metrics (one registry per instance)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.common.metrics import InstanceMetrics
from pdserve.engine.cpu_kernels import team_shared_parts


class KernelTeamParts(Collector):
    """The parts of one-row GEMMs the kernel team's threads computed (`--kernel-threads`),
    read from the kernels at each scrape."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "pdserve_decode_kernel_team_parts",
            "Parts of one-row decode GEMMs that the kernel team's threads computed "
            "(--kernel-threads); the step's own thread computes the rest. Flat while the "
            "team's threads get no core (other processes busy) or the team is one thread.",
            value=team_shared_parts(),
        )


class DecodeMetrics(InstanceMetrics):
    """Histograms observed by the decode thread and the servicer.

    Attributes:
        step_seconds: Duration of one batched decode step (forward + sampling).
        sync_seconds: Duration of one SyncCache transfer, header to commit.
        detached_requests: Resumable requests running on with no stream attached.
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
        self.registry.register(KernelTeamParts())
        self.detached_requests = Gauge(
            "pdserve_decode_detached_requests",
            "Resumable requests running on with no Generate stream attached, kept for a resume.",
            registry=self.registry,
        )

    def count_window_slots_with(self, num_free: Callable[[], float], num_slots: int) -> None:
        """Adds the window slots' gauges (a cache whose sliding layers keep only their
        window): how many there are, and how many no lease holds (read at each scrape)."""
        Gauge(
            "pdserve_decode_window_slots",
            "Window slots of the sliding-window layers' KV (--release-window-blocks).",
            registry=self.registry,
        ).set(num_slots)
        Gauge(
            "pdserve_decode_window_slots_free",
            "Window slots no lease holds; a lease needs one per block of the window before its "
            "end, and one more for each open lease's growth.",
            registry=self.registry,
        ).set_function(num_free)

    def count_detached_with(self, count: Callable[[], float]) -> None:
        """Reads the detached-requests gauge from `count` at each scrape."""
        self.detached_requests.set_function(count)
