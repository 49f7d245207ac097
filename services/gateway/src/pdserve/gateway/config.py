"""Settings of one gateway process: a frozen dataclass that also defines the CLI flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.config import ServiceConfig
from pdserve.common.etcd_registry import REGISTRY_HELP, check_registry_spec
from pdserve.gateway.config_fields import limit_field, routing_field
from pdserve.gateway.prepare.validation import RequestLimits
from pdserve.gateway.routing.policy import CacheRouting
from pdserve.gateway.routing.queue import QueueLimits

LOG_FORMATS = ("json", "console")
MIB = 1024 * 1024


def _check_address(flag: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT, got {address!r}")


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """Everything a gateway needs; each field is also a ``--kebab-case`` flag (the request
    limits' and cache routing's are declared in `config_fields`)."""

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
            "help": "public gRPC port: GenerationService (API keys, no client certificates); 0 "
            "picks a free one"
        },
    )
    internal_port: int = field(
        default=50051,
        metadata={
            "help": "internal gRPC port: RegistryService, where prefills and decodes register "
            "(mutual TLS with --tls-*; each instance may only speak for its own certificate); "
            "0 picks a free one"
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
    registry: str | None = field(default=None, metadata={"help": REGISTRY_HELP})
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
            "/metrics) and 'authorization' metadata on GenerationService; this key is named "
            "'default'"
        },
    )
    api_key_file: str | None = field(
        default=None,
        metadata={
            "help": "file of named API keys, one 'NAME:KEY[:rpm=N][:concurrency=N]' a line ('#' "
            "comments allowed), re-read within a second of a change; $PDSERVE_API_KEYS may hold "
            "more, separated by ',' (with no key anywhere the gateway is open)"
        },
    )
    requests_per_minute_per_key: float | None = field(
        default=None,
        metadata={
            "help": "generation requests one API key may start a minute (token bucket, bursts "
            "of a minute's worth); more get 429 with Retry-After; a key's rpm= replaces it; "
            "off when unset"
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
    default_chat_max_tokens: int = field(
        default=1024,
        metadata={
            "help": "max_tokens of a chat request that sets none (GenerationService always sets "
            "it), lowered to what fits in the model's length after the prompt"
        },
    )
    max_body_bytes: int = field(
        default=4 * MIB,
        metadata={
            "help": "largest REST request body in bytes; a larger one is refused with 413 "
            "before it is read (by its Content-Length) or as soon as it grows past this"
        },
    )
    grpc_max_receive_bytes: int = field(
        default=4 * MIB,
        metadata={
            "help": "largest gRPC message the gateway receives (GenerationService, "
            "RegistryService); gRPC refuses a larger one with RESOURCE_EXHAUSTED"
        },
    )
    max_prompt_chars: int = limit_field("max_prompt_chars")
    max_prompt_tokens: int = limit_field("max_prompt_tokens")
    max_messages: int = limit_field("max_messages")
    max_stop_strings: int = limit_field("max_stop_strings")
    max_stop_chars: int = limit_field("max_stop_chars")
    max_stop_token_ids: int = limit_field("max_stop_token_ids")
    max_tokens_limit: int = limit_field("max_tokens_limit")
    max_concurrent_requests: int = field(
        default=512,
        metadata={"help": "generation requests in flight on the gateway; more get 429"},
    )
    max_concurrent_requests_per_key: int = field(
        default=256,
        metadata={
            "help": "generation requests in flight per API key presented (requests without one "
            "share a count); more get 429"
        },
    )
    max_queued_requests: int = field(
        default=256,
        metadata={
            "help": "requests that may wait at once in the admission queue for a decode (and "
            "prefill) with room; one more gets 429 with Retry-After at once"
        },
    )
    max_queued_tokens: int = field(
        default=262_144,
        metadata={
            "help": "prompt tokens that may wait at once in the admission queue; a request "
            "that would pass it gets 429 with Retry-After at once"
        },
    )
    max_queue_wait_s: float = field(
        default=60.0,
        metadata={
            "help": "seconds a new request may wait in the admission queue for room; then "
            "429 with Retry-After (a request already streaming waits up to --request-timeout)"
        },
    )
    prepare_workers: int = field(
        default=4,
        metadata={
            "help": "threads that tokenize prompts and render chat templates, off the event loop"
        },
    )
    parse_processes: int = field(
        default=2,
        metadata={
            "help": "worker processes that parse request bodies and messages over 16 KiB, off "
            "the gateway's process (started on the first such request)"
        },
    )
    prepare_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "seconds a request may wait for and use a parser process, then a tokenizer "
            "thread (each); then it fails with DEADLINE_EXCEEDED (504)"
        },
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
    cache_aware_routing: bool = routing_field("is_enabled")
    cache_balance_tokens: int = routing_field("balance_tokens")
    cache_memory_blocks: int = routing_field("memory_blocks")
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
        for name in ("port", "grpc_port", "internal_port"):
            value = getattr(self, name)
            if not 0 <= value < 65536:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        try:
            check_registry_spec(self.registry)
        except ValueError as error:
            raise ValueError(f"--registry: {error}") from None
        for address in self.prefill:
            _check_address("--prefill", address)
        for address in self.decode:
            _check_address("--decode", address)
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.preempt_retry_count < 0:
            raise ValueError(f"preempt_retry_count must be >= 0, got {self.preempt_retry_count}")
        for name in (
            "default_max_tokens",
            "default_chat_max_tokens",
            "max_body_bytes",
            "grpc_max_receive_bytes",
            "max_concurrent_requests",
            "max_concurrent_requests_per_key",
            "max_queued_requests",
            "max_queued_tokens",
            "prepare_workers",
            "parse_processes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        self.request_limits()  # raises ValueError for a bad per-request limit
        self.cache_routing()  # raises ValueError for a bad routing setting
        for name in (
            "request_timeout",
            "heartbeat_interval_s",
            "instance_ttl_s",
            "poll_interval_s",
            "prepare_timeout_s",
            "max_queue_wait_s",
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
        if self.api_key_file is not None and not self.api_key_file.strip():
            raise ValueError("api_key_file must not be empty")
        rpm = self.requests_per_minute_per_key
        if rpm is not None and not 0 < rpm < float("inf"):
            raise ValueError(f"requests_per_minute_per_key must be > 0, got {rpm}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}")

    def request_limits(self) -> RequestLimits:
        """The per-request limits these settings name."""
        return RequestLimits(
            max_prompt_chars=self.max_prompt_chars,
            max_prompt_tokens=self.max_prompt_tokens,
            max_messages=self.max_messages,
            max_stop_strings=self.max_stop_strings,
            max_stop_chars=self.max_stop_chars,
            max_stop_token_ids=self.max_stop_token_ids,
            max_tokens_limit=self.max_tokens_limit,
        )

    def queue_limits(self) -> QueueLimits:
        """The admission queue's bounds these settings name."""
        return QueueLimits(
            max_queued_requests=self.max_queued_requests,
            max_queued_tokens=self.max_queued_tokens,
            max_queue_wait_s=self.max_queue_wait_s,
        )

    def cache_routing(self) -> CacheRouting:
        """The cache-aware routing settings these flags name."""
        return CacheRouting(
            is_enabled=self.cache_aware_routing,
            balance_tokens=self.cache_balance_tokens,
            memory_blocks=self.cache_memory_blocks,
        )
