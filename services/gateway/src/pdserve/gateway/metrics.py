"""The gateway's Prometheus counters, on a registry of its own (one per gateway object)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

_LABELS = {"requests": "outcome", "retries": "reason", "reschedules": "cause"}


class GatewayMetrics:
    """Counters of request outcomes, retries and reschedules.

    Attributes:
        registry: The Prometheus registry these counters live in (served at /metrics).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdserve_gateway_requests",
            "Client requests by outcome (finished, or the error reason).",
            ["outcome"],
            registry=self.registry,
        )
        self.retries = Counter(
            "pdserve_gateway_retries",
            "Attempts retried after a retryable error, by error reason.",
            ["reason"],
            registry=self.registry,
        )
        self.reschedules = Counter(
            "pdserve_gateway_reschedules",
            "Requests continued elsewhere with their generated tokens, by cause.",
            ["cause"],
            registry=self.registry,
        )

    def count(self, name: str, label: str) -> float:
        """Current value of one counter series (0 if never incremented); for tests and logs."""
        label_name = _LABELS[name]
        value = self.registry.get_sample_value(f"pdserve_gateway_{name}_total", {label_name: label})
        return value or 0.0

    def render(self) -> bytes:
        """The Prometheus text exposition of every counter."""
        return generate_latest(self.registry)
