"""The gateway's Prometheus metrics, on a registry of its own (one per gateway object)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds; from interactive (tens of ms) to a slow CPU-only cluster (a minute).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Phases of the time to first token go down to a fraction of a millisecond.
PHASE_BUCKETS = (0.0005, 0.001, *LATENCY_BUCKETS)

_LABELS = {
    "requests": "outcome",
    "retries": "reason",
    "reschedules": "cause",
    "instances_lost": "role",
    "routes": "reason",
    "queue_refusals": "bound",
    "peer_waits": "outcome",
}


class GatewayMetrics:
    """Request outcomes, retries, reschedules, lost instances, routes and latency histograms.

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
        self.instances_lost = Counter(
            "pdserve_gateway_instances_lost",
            "Instances silent past the TTL (their streams were moved), by role.",
            ["role"],
            registry=self.registry,
        )
        self.routes = Counter(
            "pdserve_gateway_routes",
            "Attempts routed, by why their prefill was chosen: prefix (it holds the longest "
            "cached prefix of the prompt within the load balance) or load (fewest queued tokens).",
            ["reason"],
            registry=self.registry,
        )

        self.resume_store_writes = Counter(
            "pdserve_gateway_resume_store_writes",
            "Records of resumable requests written to the shared store (a bounded number per "
            "request: its start, each decode that took it, its end).",
            registry=self.registry,
        )
        self.resumes = Counter(
            "pdserve_gateway_resumes",
            "Resumable requests read or streamed again, by how: local (this gateway holds "
            "it), stored (it ended; made again from its stored tokens), takeover (attached "
            "to where another gateway left it) or adopted (its gateway died; taken over "
            "here with no client asking).",
            ["how"],
            registry=self.registry,
        )

        self.queued_requests = Gauge(
            "pdserve_gateway_queued_requests",
            "Requests waiting in the admission queue for a pair with room.",
            registry=self.registry,
        )
        self.queued_tokens = Gauge(
            "pdserve_gateway_queued_prompt_tokens",
            "Prompt tokens of the requests waiting in the admission queue.",
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "pdserve_gateway_queue_wait_seconds",
            "Time a request spent in the admission queue (each wait; requests routed at once "
            "are not observed).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_refusals = Counter(
            "pdserve_gateway_queue_refusals",
            "Requests refused by the admission queue, by the bound they met: "
            "max_queued_requests, max_queued_tokens or max_queue_wait_s.",
            ["bound"],
            registry=self.registry,
        )
        self.peer_waits = Counter(
            "pdserve_gateway_peer_waits",
            "Requests that had a setback and found no prefill/decode pair alive, by how their "
            "wait ended: came_back (a pair registered again and it went on) or timed_out "
            "(--peer-wait-s or its deadline passed first).",
            ["outcome"],
            registry=self.registry,
        )
        self.peer_waiting = Gauge(
            "pdserve_gateway_peer_waiting_requests",
            "Requests waiting now for a prefill/decode pair to come back.",
            registry=self.registry,
        )
        self.peer_wait = Histogram(
            "pdserve_gateway_peer_wait_seconds",
            "Time a request waited for a prefill/decode pair to come back (each wait).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        self.ttft = Histogram(
            "pdserve_gateway_time_to_first_token_seconds",
            "From request start to the first token delivered to the client.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "pdserve_gateway_inter_token_latency_seconds",
            "Gap between consecutive tokens delivered to a client (a batch shares its gap).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft_phase_seconds = Histogram(
            "pdserve_gateway_ttft_phase_seconds",
            "Where the time to first token went, by phase: gateway_queue, network, lease, "
            "prefill_queue, compute, first_token_to_client; and transfer_tail (first token to "
            "the decode's KV commit, which delays the second token). See docs/observability.md.",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "pdserve_gateway_request_duration_seconds",
            "From request start to the last token of a finished request.",
            buckets=LATENCY_BUCKETS,
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
