"""`GatewayConfig` fields that mirror a settings class of their own: the per-request limits
(`RequestLimits`) and cache-aware routing (`CacheRouting`).

Each such flag takes its default from that class (so it is written once) and its help text
from here; `GatewayConfig.request_limits()` and `cache_routing()` build the classes back.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from pdserve.gateway.prepare.validation import RequestLimits
from pdserve.gateway.routing.policy import CacheRouting

_LIMITS = RequestLimits()  # the defaults of the per-request limits live there once
_ROUTING = CacheRouting()  # and those of cache-aware routing there

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
