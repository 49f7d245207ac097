"""`GatewayConfig`'s fields written once: those that mirror a settings class of their own (the
per-request limits, `RequestLimits`; cache-aware routing, `CacheRouting`; the admission queue's
bounds, `QueueLimits`), the ports, and the check of an instance address.

Each mirroring flag takes its default from that class (so it is written once) and its help text
and range from here; `GatewayConfig.request_limits()`, `cache_routing()` and `queue_limits()`
build the classes back (`settings_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field
from typing import Any

from pdserve.gateway.prepare.validation import RequestLimits
from pdserve.gateway.routing.policy import CacheRouting
from pdserve.gateway.routing.queue_bounds import QueueLimits

_LIMITS = RequestLimits()  # the defaults of the per-request limits live there once
_ROUTING = CacheRouting()  # and those of cache-aware routing there
_QUEUE = QueueLimits()  # and those of the admission queue there

LIMIT_HELP = {
    "max_prompt_chars": "characters of a text prompt, or of all chat messages together",
    "max_prompt_tokens": "tokens of a prompt (after the chat template); a prompt must also leave "
    "the model's length room for one generated token",
    "max_messages": "messages of one chat request",
    "max_stop_strings": "stop strings of one request",
    "max_stop_chars": "characters of one stop string",
    "max_stop_token_ids": "stop token ids of one request",
    "max_tokens_limit": "largest max_tokens a request may ask for; 0: whatever fits in the "
    "model's length after the prompt",
    "max_n": "completions one request may ask for (n)",
    "max_prompts": "prompts of one completions request (a list of prompts)",
    "max_logit_bias": "logit_bias entries of one request",
    "max_tools": "tools (functions) of one chat request",
    "max_constraint_chars": "characters of one request's constraint (schema, regex, grammar or "
    "choices together)",
}
"""Help of each `RequestLimits` field's flag (same name)."""

ROUTING_HELP = {
    "is_enabled": "send a prompt to the prefill believed to hold its longest prefix in its "
    "prefix cache (off: always the prefill with the fewest queued prompt tokens)",
    "balance_tokens": "a prefill holding a prompt's prefix is preferred unless its queued "
    "prompt tokens exceed the least-loaded prefill's by more than this",
    "memory_blocks": "block keys remembered per prefill for cache-aware routing (least "
    "recently routed forgotten first; at most the prefill's pool size)",
}
"""Help of the flags of `CacheRouting`'s fields (``--cache-aware-routing``,
``--cache-balance-tokens``, ``--cache-memory-blocks``)."""


def limit_field(name: str) -> Any:
    """The config field of the `RequestLimits` field `name`: its default and help."""
    return field(default=getattr(_LIMITS, name), metadata={"help": LIMIT_HELP[name]})


def routing_field(name: str) -> Any:
    """The config field of the `CacheRouting` field `name`: its default and help."""
    return field(default=getattr(_ROUTING, name), metadata={"help": ROUTING_HELP[name]})


QUEUE_HELP = {
    "max_queued_requests": "requests that may wait at once in the admission queue for a "
    "decode (and prefill) with room; one more gets 429 with Retry-After at once",
    "max_queued_tokens": "prompt tokens that may wait at once in the admission queue; a "
    "request that would pass it gets 429 with Retry-After at once",
    "max_queue_wait_s": "seconds a new request may wait in the admission queue for room; then "
    "429 with Retry-After (a request already streaming waits up to --request-timeout)",
}
"""Help of the flags of `QueueLimits`' fields (same names)."""

QUEUE_RANGES: dict[str, dict[str, float]] = {
    "max_queued_requests": {"min": 1},
    "max_queued_tokens": {"min": 1},
    "max_queue_wait_s": {"gt": 0},
}


def queue_field(name: str) -> Any:
    """The config field of the `QueueLimits` field `name`: its default, help and range."""
    metadata = {"help": QUEUE_HELP[name], **QUEUE_RANGES[name]}
    return field(default=getattr(_QUEUE, name), metadata=metadata)


LIMIT_FLAGS = {name: name for name in LIMIT_HELP}
"""`RequestLimits`' fields and their config fields (same names)."""
ROUTING_FLAGS = {
    "is_enabled": "cache_aware_routing",
    "balance_tokens": "cache_balance_tokens",
    "memory_blocks": "cache_memory_blocks",
}
"""`CacheRouting`'s fields and their config fields."""
QUEUE_FLAGS = {name: name for name in QUEUE_HELP}
"""`QueueLimits`' fields and their config fields (same names)."""


def settings_of(config: object, flags: Mapping[str, str]) -> dict[str, Any]:
    """The keyword arguments of a settings class from `config`'s fields named in `flags`."""
    return {name: getattr(config, flag) for name, flag in flags.items()}


def port_field(default: int, help_text: str) -> Any:
    """A port's config field: 0 to 65535, where 0 picks a free port."""
    return field(
        default=default,
        metadata={"help": f"{help_text}; 0 picks a free one", "min": 0, "max": 65535},
    )


def check_address(flag: str, address: str) -> None:
    """Refuses an instance address (``--prefill``, ``--decode``) that is not HOST:PORT."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT, got {address!r}")
