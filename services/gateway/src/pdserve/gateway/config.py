"""Settings of one gateway process: a frozen dataclass that also defines the CLI flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.config import ServiceConfig

LOG_FORMATS = ("json", "console")


def _check_address(flag: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT, got {address!r}")


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """Everything a gateway needs; each field is also a ``--kebab-case`` flag."""

    host: str = field(
        default="0.0.0.0",
        metadata={"help": "address the REST and gRPC servers bind to"},
    )
    port: int = field(
        default=8000,
        metadata={"help": "REST (OpenAI-compatible) port; 0 picks a free one"},
    )
    grpc_port: int = field(
        default=50050,
        metadata={
            "help": "gRPC port for GenerationService (public API) and RegistryService (instances "
            "register here); 0 picks a free one"
        },
    )
    prefill: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "HOST:PORT of a prefill instance to use without registration (repeatable); "
            "polled for health and load"
        },
    )
    decode: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "HOST:PORT of a static decode instance (repeatable); polled like --prefill"
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "model directory with tokenizer.json (and tokenizer_config.json, chat "
            "template) to use for every model instead of fetching it from a prefill"
        },
    )
    api_key: str | None = field(
        default=None,
        metadata={
            "help": "require 'Authorization: Bearer KEY' on the REST API (except /health and "
            "/metrics) and 'authorization' metadata on GenerationService"
        },
    )
    max_attempts: int = field(
        default=3,
        metadata={
            "help": "attempts per request for retryable errors (capacity, draining, lease or "
            "KV transfer failures), each on another instance where the error says so"
        },
    )
    preempt_retry_count: int = field(
        default=4,
        metadata={
            "help": "how often one request may be rescheduled (prompt + generated tokens) after "
            "a decode preempted it or was lost mid-stream"
        },
    )
    preempt_retry_exclude_decode: bool = field(
        default=False,
        metadata={"help": "reschedule a preempted request on a different decode instance"},
    )
    request_timeout: float = field(
        default=600.0,
        metadata={"help": "seconds one request may take in all, retries included"},
    )
    default_max_tokens: int = field(
        default=16,
        metadata={"help": "max_tokens of a /v1/completions request that does not set it"},
    )
    heartbeat_interval_s: float = field(
        default=2.0,
        metadata={"help": "heartbeat interval the registry asks instances for, in seconds"},
    )
    instance_ttl_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds without a heartbeat after which an instance is lost: "
            "dropped, and its streams move to other instances"
        },
    )
    poll_interval_s: float = field(
        default=2.0,
        metadata={"help": "seconds between status polls of --prefill/--decode instances"},
    )
    unavailable_retry_after_s: float = field(
        default=1.0,
        metadata={"help": "retry delay (Retry-After) suggested when no healthy pair exists"},
    )
    shutdown_grace_s: float = field(
        default=10.0,
        metadata={"help": "seconds a stopping gateway lets running requests finish"},
    )
    trace_polls: bool = field(
        default=False,
        metadata={
            "help": "with tracing on, also trace polls: /health, /livez, /v1/models, /metrics "
            "(by default only generation requests make traces)"
        },
    )
    log_format: str = field(
        default="json", metadata={"help": "log line format", "choices": LOG_FORMATS}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("port", "grpc_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        for address in self.prefill:
            _check_address("--prefill", address)
        for address in self.decode:
            _check_address("--decode", address)
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.preempt_retry_count < 0:
            raise ValueError(f"preempt_retry_count must be >= 0, got {self.preempt_retry_count}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        for name in (
            "request_timeout",
            "heartbeat_interval_s",
            "instance_ttl_s",
            "poll_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("unavailable_retry_after_s", "shutdown_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.instance_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                "instance_ttl_s must exceed heartbeat_interval_s "
                f"({self.instance_ttl_s} <= {self.heartbeat_interval_s})"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}")
