"""Settings of one gateway process: a frozen dataclass that also defines the CLI flags."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config import (
    ServiceConfig,
    mirror_field,
    port_setting,
    setting,
    settings_of,
)
from pdserve.common.etcd_registry import REGISTRY_HELP, check_registry_spec
from pdserve.gateway.prepare.validation import RequestLimits
from pdserve.gateway.reasoning import REASONING_PARSERS
from pdserve.gateway.routing.policy import CacheRouting
from pdserve.gateway.routing.queue_bounds import QueueLimits
from pdserve.gateway.tools.formats import AUTO, TOOL_CALL_PARSERS

LOG_FORMATS = ("json", "console")
MIB = 1024 * 1024


def check_address(flag: str, address: str) -> None:
    """Refuses an instance address (``--prefill``, ``--decode``) that is not HOST:PORT."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT, got {address!r}")


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """Everything a gateway needs; each field is also a ``--kebab-case`` flag (those of the
    request limits, the admission queue's bounds and cache routing mirror `RequestLimits`,
    `QueueLimits` and `CacheRouting`, which hold their defaults and help text)."""

    host: str = setting("0.0.0.0", "address the REST and gRPC servers bind to")
    port: int = port_setting(8000, "REST (OpenAI-compatible) port; 0 picks a free one")
    grpc_port: int = port_setting(
        50050,
        "public gRPC port: GenerationService (API keys, no client certificates); 0 picks a "
        "free one",
    )
    internal_port: int = port_setting(
        50051,
        "internal gRPC port: RegistryService, where prefills and decodes register (mutual TLS "
        "with --tls-*; each instance may only speak for its own certificate); 0 picks a free "
        "one",
    )
    prefill: tuple[str, ...] = setting(
        (),
        "HOST:PORT of a prefill instance to use without registration (repeatable); "
        "polled for health and load",
    )
    decode: tuple[str, ...] = setting(
        (), "HOST:PORT of a static decode instance (repeatable); polled like --prefill"
    )
    registry: str | None = setting(None, REGISTRY_HELP)
    tokenizer: str | None = setting(
        None,
        "model directory with tokenizer.json (and tokenizer_config.json, chat "
        "template) to use for every model instead of fetching it from a prefill",
    )
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer KEY' on the REST API (except /health and "
        "/metrics) and 'authorization' metadata on GenerationService; this key is named "
        "'default'",
    )
    api_key_file: str | None = setting(
        None,
        "file of named API keys, one 'NAME:KEY[:rpm=N][:concurrency=N]' a line ('#' "
        "comments allowed), re-read within a second of a change; $PDSERVE_API_KEYS may hold "
        "more, separated by ',' (with no key anywhere the gateway is open)",
    )
    requests_per_minute_per_key: float | None = setting(
        None,
        "generation requests one API key may start a minute (token bucket, bursts "
        "of a minute's worth); more get 429 with Retry-After; a key's rpm= replaces it; "
        "off when unset",
        gt=0,
    )
    max_attempts: int = setting(
        3,
        "attempts per request for retryable errors (capacity, draining, lease or "
        "KV transfer failures), each on another instance where the error says so",
        min=1,
    )
    preempt_retry_count: int = setting(
        4,
        "how often one request may be rescheduled (prompt + generated tokens) after "
        "a decode preempted it or was lost mid-stream",
        min=0,
    )
    preempt_retry_exclude_decode: bool = setting(
        False, "reschedule a preempted request on a different decode instance"
    )
    peer_wait_s: float = setting(
        30.0,
        "seconds a request that lost its instance (or failed an attempt) waits for "
        "a prefill/decode pair to register again when none is alive, before it fails; the "
        "request timeout bounds it too; 0 fails at once",
        min=0,
    )
    request_timeout: float = setting(
        600.0, "seconds one request may take in all, retries included", gt=0
    )
    default_max_tokens: int = setting(
        16, "max_tokens of a /v1/completions request that does not set it", min=1
    )
    default_chat_max_tokens: int = setting(
        1024,
        "max_tokens of a chat request that sets none (GenerationService always sets "
        "it), lowered to what fits in the model's length after the prompt",
        min=1,
    )
    max_body_bytes: int = setting(
        4 * MIB,
        "largest REST request body in bytes; a larger one is refused with 413 "
        "before it is read (by its Content-Length) or as soon as it grows past this",
        min=1,
    )
    grpc_max_receive_bytes: int = setting(
        4 * MIB,
        "largest gRPC message the gateway receives (GenerationService, "
        "RegistryService); gRPC refuses a larger one with RESOURCE_EXHAUSTED",
        min=1,
    )
    max_prompt_chars: int = mirror_field(RequestLimits, "max_prompt_chars")
    max_prompt_tokens: int = mirror_field(RequestLimits, "max_prompt_tokens")
    max_messages: int = mirror_field(RequestLimits, "max_messages")
    max_stop_strings: int = mirror_field(RequestLimits, "max_stop_strings")
    max_stop_chars: int = mirror_field(RequestLimits, "max_stop_chars")
    max_stop_token_ids: int = mirror_field(RequestLimits, "max_stop_token_ids")
    max_bad_words: int = mirror_field(RequestLimits, "max_bad_words")
    max_allowed_token_ids: int = mirror_field(RequestLimits, "max_allowed_token_ids")
    max_tokens_limit: int = mirror_field(RequestLimits, "max_tokens_limit")
    max_n: int = mirror_field(RequestLimits, "max_n")
    max_prompts: int = mirror_field(RequestLimits, "max_prompts")
    max_logit_bias: int = mirror_field(RequestLimits, "max_logit_bias")
    max_tools: int = mirror_field(RequestLimits, "max_tools")
    tool_call_parser: str = setting(
        AUTO,
        "how tool calls are read from a model's output (tool_choice auto) and "
        "shown to a model whose chat template does not render tools: hermes "
        "(<tool_call>{...}</tool_call>: Hermes, Qwen 2.5/3, SmolLM), llama3_json "
        '({"name": ..., "parameters": ...}: Llama 3.1-3.3), harmony (gpt-oss: '
        "commentary messages to=functions.NAME; its analysis channel is the reasoning), "
        "deepseek_v3 (DeepSeek-V3/R1: <｜tool▁calls▁begin｜>...); auto picks by the chat "
        "template: harmony, deepseek_v3 or llama3_json for a template that writes that "
        "format's markers, hermes otherwise",
        choices=TOOL_CALL_PARSERS,
    )
    reasoning_parser: str = setting(
        AUTO,
        "how a chat completion's reasoning is read: think (what the model writes "
        "between <think> and </think>, as Qwen3 and DeepSeek-R1 do, goes to "
        "reasoning_content, streamed too; the rest to content), none (all content); auto "
        "reads it for a model whose chat template knows </think>",
        choices=REASONING_PARSERS,
    )
    max_constraint_chars: int = mirror_field(RequestLimits, "max_constraint_chars")
    max_concurrent_requests: int = setting(
        512, "generation requests in flight on the gateway; more get 429", min=1
    )
    max_concurrent_requests_per_key: int = setting(
        256,
        "generation requests in flight per API key presented (requests without one "
        "share a count); more get 429",
        min=1,
    )
    max_stored_responses: int = setting(
        1024,
        "requests this gateway keeps in the store at once, running or ended (stored and "
        "background responses, resumable streams); past it a new one takes the place of "
        "the ended one nearest its expiry, and gets 429 only when all of them are running",
        min=1,
    )
    response_keep_s: float = setting(
        600.0,
        "seconds an ended response (stored or background) or resumable stream stays "
        "readable, resumable and continuable by previous_response_id (then: 404)",
        gt=0,
    )
    resume_holder_ttl_s: float = setting(
        10.0,
        "with --registry etcd://...: seconds after this gateway stops answering "
        "etcd (it died) before another gateway sharing the etcd adopts its running "
        "background responses and resumable streams and runs them to their end",
        gt=0,
    )
    max_queued_requests: int = mirror_field(QueueLimits, "max_queued_requests")
    max_queued_tokens: int = mirror_field(QueueLimits, "max_queued_tokens")
    max_queue_wait_s: float = mirror_field(QueueLimits, "max_queue_wait_s")
    prepare_workers: int = setting(
        4, "threads that tokenize prompts and render chat templates, off the event loop", min=1
    )
    parse_processes: int = setting(
        2,
        "worker processes that parse request bodies and messages over 16 KiB, off "
        "the gateway's process (started on the first such request)",
        min=1,
    )
    prepare_timeout_s: float = setting(
        10.0,
        "seconds a request may wait for and use a parser process, then a tokenizer "
        "thread (each); then it fails with DEADLINE_EXCEEDED (504)",
        gt=0,
    )
    heartbeat_interval_s: float = setting(
        2.0, "heartbeat interval the registry asks instances for, in seconds", gt=0
    )
    instance_ttl_s: float = setting(
        10.0,
        "seconds without a heartbeat after which an instance is lost: "
        "dropped, and its streams move to other instances",
        gt=0,
    )
    poll_interval_s: float = setting(
        2.0, "seconds between status polls of --prefill/--decode instances", gt=0
    )
    cache_aware_routing: bool = mirror_field(CacheRouting, "is_enabled")
    cache_balance_tokens: int = mirror_field(CacheRouting, "balance_tokens")
    cache_memory_blocks: int = mirror_field(CacheRouting, "memory_blocks")
    unavailable_retry_after_s: float = setting(
        1.0, "retry delay (Retry-After) suggested when no healthy pair exists", min=0
    )
    shutdown_grace_s: float = setting(
        10.0, "seconds a stopping gateway lets running requests finish", min=0
    )
    trace_polls: bool = setting(
        False,
        "with tracing on, also trace polls: /health, /livez, /v1/models, /metrics "
        "(by default only generation requests make traces)",
    )
    log_format: str = setting("json", "log line format", choices=LOG_FORMATS)

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            check_registry_spec(self.registry)
        except ValueError as error:
            raise ValueError(f"--registry: {error}") from None
        for address in self.prefill:
            check_address("--prefill", address)
        for address in self.decode:
            check_address("--decode", address)
        self.request_limits()  # raises ValueError for a bad per-request limit
        self.cache_routing()  # raises ValueError for a bad routing setting
        if self.instance_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                "instance_ttl_s must exceed heartbeat_interval_s "
                f"({self.instance_ttl_s} <= {self.heartbeat_interval_s})"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.api_key_file is not None and not self.api_key_file.strip():
            raise ValueError("api_key_file must not be empty")

    def request_limits(self) -> RequestLimits:
        """The per-request limits these settings name."""
        return settings_of(self, RequestLimits)

    def queue_limits(self) -> QueueLimits:
        """The admission queue's bounds these settings name."""
        return settings_of(self, QueueLimits)

    def cache_routing(self) -> CacheRouting:
        """The cache-aware routing settings these flags name."""
        return settings_of(self, CacheRouting)
