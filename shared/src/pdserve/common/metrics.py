"""Prometheus metrics shared by the prefill and decode services.

Gauges of an instance's load are read from its `LoadReport` at scrape time (the same report
its heartbeats carry), and monotonic counts from plain integers the service keeps, so hot
paths do not touch Prometheus objects. Histograms are observed where the work happens.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.grpc_server import ListenError
from pdserve.v1 import common_pb2

# Seconds; from a millisecond (a decode step) to a minute (a long prompt on a small CPU).
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60)

_LOAD_GAUGES = (
    ("queued_prompt_tokens", "num_queued_prompt_tokens", "Prompt tokens waiting for prefill."),
    ("queued_requests", "num_queued_requests", "Requests accepted but not yet running."),
    ("running_requests", "num_running_requests", "Requests being prefilled or decoded."),
    ("free_blocks", "num_free_blocks", "KV blocks free for allocation."),
    ("total_blocks", "num_total_blocks", "All KV blocks."),
    ("leased_blocks", "num_leased_blocks", "KV blocks held by leases not yet running."),
    ("reserved_blocks", "num_reserved_blocks", "Free KV blocks owed as growth headroom."),
    ("draining", "is_draining", "1 while the instance drains."),
)

CounterSource = Callable[[], Mapping[str, tuple[str, float]]]


class InstanceCollector(Collector):
    """Exposes a load report as gauges and a service's running totals as counters.

    Args:
        service: Metric name part, e.g. "decode" gives ``pdserve_decode_free_blocks``.
        load_report: Returns the current `LoadReport`.
        counters: Returns ``{name: (help, value)}`` of monotonic totals; ``name`` without the
            ``_total`` suffix, which Prometheus adds.
    """

    def __init__(
        self,
        service: str,
        load_report: Callable[[], common_pb2.LoadReport],
        counters: CounterSource,
    ) -> None:
        self.prefix = f"pdserve_{service}_"
        self.load_report = load_report
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        report = self.load_report()
        for name, field, text in _LOAD_GAUGES:
            yield GaugeMetricFamily(self.prefix + name, text, value=float(getattr(report, field)))
        for name, (text, value) in self.counters().items():
            yield CounterMetricFamily(self.prefix + name, text, value=value)


class InstanceMetrics:
    """A service instance's registry: its histograms plus the load/counter collector.

    Args:
        service: Metric name part ("prefill", "decode").
    """

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()

    def histogram(self, name: str, text: str, labelnames: Sequence[str] = ()) -> Histogram:
        """A duration histogram ``pdserve_<service>_<name>`` on this registry.

        Args:
            name: Name after the service prefix, e.g. ``pass_seconds``.
            text: The help text.
            labelnames: Its labels, if any (then observe through ``.labels(...)``).
        """
        return Histogram(
            f"pdserve_{self.service}_{name}",
            text,
            labelnames,
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )

    def watch(
        self, load_report: Callable[[], common_pb2.LoadReport], counters: CounterSource
    ) -> None:
        """Adds the load gauges and running totals, read at scrape time."""
        self.registry.register(InstanceCollector(self.service, load_report, counters))


# NOTE: how often the serving thread looks whether `shutdown()` was asked: prometheus_client's
# start_http_server keeps socketserver's 0.5 s, which every stop of an instance waited out.
SHUTDOWN_POLL_S = 0.05


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serves `registry` at ``http://host:port/metrics`` on a background thread (as
    prometheus_client's ``start_http_server``, with a prompt ``shutdown``).

    Returns:
        The server: ``server_port`` is the bound port (useful with port 0), ``shutdown()``
        stops it.

    Raises:
        ListenError: The port cannot be bound.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    server_type = type("MetricsServer", (_MetricsServer,), {"address_family": family})
    try:
        server: WSGIServer = make_server(
            host, port, make_wsgi_app(registry), server_type, _QuietHandler
        )
    except OSError as error:
        raise ListenError.of_socket(host, port, error) from error
    thread = threading.Thread(
        target=server.serve_forever, args=(SHUTDOWN_POLL_S,), name="metrics", daemon=True
    )
    thread.start()
    return server
