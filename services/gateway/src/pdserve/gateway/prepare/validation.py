"""The one validator of generation requests, whichever front end (REST or gRPC) they came by.

`validate_request` checks a `GenerationParams` before any tokenization or instance work: the
ranges the contract's wire types allow (checked here, before any conversion could fail), the
gateway's `RequestLimits`, valid Unicode in every string, and the chat messages and tools, per
role (`pdserve.gateway.prepare.messages`). It returns the params with roles normalized
(``developer`` is ``system``, as in the OpenAI API). Every failure is an INVALID_REQUEST naming
the offending parameter.

What needs the model (its vocabulary, its maximum length) is checked by the front end once it
knows the model.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pdserve.common import constraints
from pdserve.common.config import setting
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import MAX_SEED
from pdserve.gateway.prepare.messages import (
    check_name,
    check_text,
    checked_messages,
    invalid,
    with_tool_constraint,
)
from pdserve.gateway.prepare.params import GenerationParams

__all__ = [
    "RequestLimits",
    "check_constraint",
    "check_counts",
    "check_text",
    "invalid",
    "validate_request",
]

MAX_UINT32 = 2**32 - 1
MAX_FLOAT32 = 3.4028234663852886e38


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; each is a gateway flag of the same name, whose help text
    is the field's (``metadata["help"]``)."""

    max_prompt_chars: int = setting(
        1_000_000, "characters of a text prompt, or of all chat messages together"
    )
    max_prompt_tokens: int = setting(
        131072,
        "tokens of a prompt (after the chat template); a prompt must also leave the "
        "model's length room for one generated token",
    )
    max_messages: int = setting(1024, "messages of one chat request")
    max_stop_strings: int = setting(16, "stop strings of one request")
    max_stop_chars: int = setting(256, "characters of one stop string")
    max_stop_token_ids: int = setting(64, "stop token ids of one request")
    max_bad_words: int = setting(
        64, "bad_words of one request (each at most --max-stop-chars characters)"
    )
    max_allowed_token_ids: int = setting(65536, "allowed_token_ids of one request")
    max_tokens_limit: int = setting(
        0,
        "largest max_tokens a request may ask for; 0: whatever fits in the model's "
        "length after the prompt",
    )
    max_n: int = setting(16, "completions one request may ask for (n)")
    max_prompts: int = setting(64, "prompts of one completions request (a list of prompts)")
    max_logit_bias: int = setting(1024, "logit_bias entries of one request")
    max_tools: int = setting(128, "tools (functions) of one chat request")
    max_constraint_chars: int = setting(
        100_000,
        "characters of one request's constraint (schema, regex, grammar or choices together)",
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            lowest = 0 if field.name == "max_tokens_limit" else 1
            if value < lowest:
                raise ValueError(f"{field.name} must be >= {lowest}, got {value}")
        if self.max_tokens_limit > MAX_UINT32:
            raise ValueError(f"max_tokens_limit must be <= {MAX_UINT32}")


def _check_range(value: float | None, lowest: float, highest: float, param: str) -> None:
    # NOTE: NaN fails both comparisons, so it is refused too.
    if value is None or lowest <= value <= highest:
        return
    if highest in (MAX_FLOAT32, MAX_UINT32) and not value > highest:
        # NOTE: the wire format's own bound is no limit a client chose to meet: not quoted.
        raise invalid(f"{param} must be >= {lowest:g}", param)
    bounds = ", ".join(f"{b:g}" if isinstance(b, float) else str(b) for b in (lowest, highest))
    raise invalid(f"{param} must be in [{bounds}]", param)


def check_counts(
    limits: RequestLimits,
    *,
    num_messages: int = 0,
    num_prompt_tokens: int = 0,
    num_stop_strings: int = 0,
    num_stop_token_ids: int = 0,
    num_tools: int = 0,
    num_bad_words: int = 0,
    num_allowed_token_ids: int = 0,
) -> None:
    """Checks how many items a request's lists hold, before anything walks them.

    `validate_request` starts with it; a front end may call it first on its own message (a
    parsed protobuf) to refuse an oversized list before converting it.

    Raises:
        PdserveError: INVALID_REQUEST, or PROMPT_TOO_LONG for too many prompt tokens.
    """
    if num_messages > limits.max_messages:
        raise invalid(f"at most {limits.max_messages} messages", "messages")
    if num_prompt_tokens > limits.max_prompt_tokens:
        raise PdserveError(
            ErrorReason.PROMPT_TOO_LONG,
            f"the prompt has {num_prompt_tokens} tokens; at most {limits.max_prompt_tokens} "
            "are accepted",
            {"param": "prompt"},
        )
    if num_stop_strings > limits.max_stop_strings:
        raise invalid(f"at most {limits.max_stop_strings} stop strings", "stop")
    if num_stop_token_ids > limits.max_stop_token_ids:
        raise invalid(f"at most {limits.max_stop_token_ids} stop_token_ids", "stop_token_ids")
    if num_tools > limits.max_tools:
        raise invalid(f"at most {limits.max_tools} tools", "tools")
    if num_bad_words > limits.max_bad_words:
        raise invalid(f"at most {limits.max_bad_words} bad_words", "bad_words")
    if num_allowed_token_ids > limits.max_allowed_token_ids:
        raise invalid(
            f"at most {limits.max_allowed_token_ids} allowed_token_ids", "allowed_token_ids"
        )


def _check_sampling(params: GenerationParams, limits: RequestLimits) -> None:
    max_tokens_limit = limits.max_tokens_limit or MAX_UINT32
    # NOTE: max_tokens 0 scores the prompt only (echo with logprobs).
    lowest = 0 if params.echo and params.prompt_logprobs is not None else 1
    _check_range(params.max_tokens, lowest, max_tokens_limit, params.max_tokens_name)
    _check_range(params.temperature, 0.0, MAX_FLOAT32, "temperature")
    if params.top_p is not None and not (math.isfinite(params.top_p) and 0 < params.top_p <= 1):
        raise invalid("top_p must be in (0, 1]", "top_p")
    _check_range(params.top_k, 0, MAX_UINT32, "top_k")
    _check_range(params.seed, 0, MAX_SEED - 1, "seed")
    _check_controls(params, limits)
    _check_constraint(params, limits)
    if any(not 0 <= token_id <= MAX_UINT32 for token_id in params.stop_token_ids):
        raise invalid("stop_token_ids must be token ids (>= 0)", "stop_token_ids")
    truncate = params.truncate_prompt_tokens
    if truncate is not None and truncate != -1 and not 1 <= truncate <= MAX_UINT32:
        raise invalid(
            "truncate_prompt_tokens must be >= 1 (the prompt's last tokens kept) or -1 (as "
            "many as fit)",
            "truncate_prompt_tokens",
        )
    for stop in params.stop:
        if not 0 < len(stop) <= limits.max_stop_chars:
            raise invalid(f"stop strings must have 1 to {limits.max_stop_chars} characters", "stop")
        check_text(stop, "stop")
    _check_token_filters(params, limits)


def _check_token_filters(params: GenerationParams, limits: RequestLimits) -> None:
    """allowed_token_ids and bad_words (the vocabulary is checked once the model is known)."""
    if any(not 0 <= token_id <= MAX_UINT32 for token_id in params.allowed_token_ids):
        raise invalid("allowed_token_ids must be token ids (>= 0)", "allowed_token_ids")
    for word in params.bad_words:
        if not word.strip() or len(word) > limits.max_stop_chars:
            raise invalid(
                f"bad_words must have 1 to {limits.max_stop_chars} characters, not only spaces",
                "bad_words",
            )
        check_text(word, "bad_words")
    for ids in params.bad_word_ids:
        if not ids or any(not 0 <= token_id <= MAX_UINT32 for token_id in ids):
            raise invalid("bad_words must be one or more token ids (>= 0) each", "bad_words")


def _check_controls(params: GenerationParams, limits: RequestLimits) -> None:
    """Penalties, logit_bias, min_tokens, min_p, logprobs and n."""
    _check_range(params.presence_penalty, -2.0, 2.0, "presence_penalty")
    _check_range(params.frequency_penalty, -2.0, 2.0, "frequency_penalty")
    if params.repetition_penalty is not None and not (
        math.isfinite(params.repetition_penalty) and 0 < params.repetition_penalty <= 2
    ):
        raise invalid("repetition_penalty must be in (0, 2]", "repetition_penalty")
    _check_range(params.min_p, 0.0, 1.0, "min_p")
    _check_range(params.min_tokens, 0, MAX_UINT32, "min_tokens")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise invalid(f"min_tokens must be <= {params.max_tokens_name}", "min_tokens")
    _check_range(params.logprobs, 0, params.max_logprobs, params.logprobs_name)
    _check_range(params.prompt_logprobs, 0, params.max_logprobs, params.logprobs_name)
    _check_range(params.n, 1, limits.max_n, "n")
    if len(params.logit_bias) > limits.max_logit_bias:
        raise invalid(f"at most {limits.max_logit_bias} logit_bias entries", "logit_bias")
    for token_id, bias in params.logit_bias:
        if not 0 <= token_id <= MAX_UINT32:
            raise invalid("logit_bias keys must be token ids (>= 0)", "logit_bias")
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise invalid("logit_bias values must be in [-100, 100]", "logit_bias")


def _check_constraint(params: GenerationParams, limits: RequestLimits) -> None:
    """The constraint fits the limits (whether it compiles: `check_constraint`)."""
    constraint = params.constraint
    if constraint is None:
        return
    name = params.constraint_name
    if params.ignore_eos:
        raise invalid(f"ignore_eos cannot be combined with {name}", "ignore_eos")
    num_chars = len(constraint.value) + sum(len(choice) for choice in constraint.choices)
    if num_chars > limits.max_constraint_chars:
        raise invalid(
            f"the {name} constraint has {num_chars} characters; at most "
            f"{limits.max_constraint_chars} are accepted",
            name,
        )
    check_text(constraint.value, name)
    for choice in constraint.choices:
        if not choice:
            raise invalid("choices must not be empty strings", name)
        check_text(choice, name)


def check_constraint(params: GenerationParams) -> GenerationParams:
    """The request with its constraint (if any) checked: llguidance compiles its grammar. A
    GBNF grammar comes back converted to Lark syntax, so the instances need not convert it.

    Not part of `validate_request`: a grammar of a few hundred bytes can take llguidance a
    few hundred milliseconds to check, so the gateway runs this on a worker thread (the check
    lets go of the GIL), once per request, after `validate_request` has bounded its size.

    Raises:
        PdserveError: INVALID_REQUEST naming the constraint's parameter.
    """
    if params.constraint is None:
        return params
    try:
        constraint = constraints.in_lark(params.constraint)
        constraints.check(constraint)
    except PdserveError as error:
        raise invalid(error.message, params.constraint_name) from None
    return dataclasses.replace(params, constraint=constraint)


def _check_chat(params: GenerationParams, limits: RequestLimits) -> GenerationParams:
    """The messages and tools' rules (`pdserve.gateway.prepare.messages`) and their size."""
    assert params.messages is not None
    messages = checked_messages(params.messages)
    num_chars = sum(m.num_chars for m in messages) + params.num_tool_chars
    if num_chars > limits.max_prompt_chars:
        raise invalid(
            f"the messages have {num_chars} characters; at most {limits.max_prompt_chars} "
            "are accepted",
            "messages",
        )
    if any(a is not b for a, b in zip(messages, params.messages, strict=True)):
        return dataclasses.replace(params, messages=messages)
    return params


def validate_request(params: GenerationParams, limits: RequestLimits) -> GenerationParams:
    """Checks a request before any work; returns it with chat roles normalized.

    Raises:
        PdserveError: INVALID_REQUEST (with ``param``) for anything out of range or limits,
            invalid Unicode, an unknown role, or not exactly one prompt input.
    """
    if not params.model:
        raise invalid("model is required", "model")
    check_name(params.model, "model")
    check_name(params.user, "user")
    check_name(params.client_request_id, "request_id")
    check_counts(
        limits,
        num_messages=len(params.messages or ()),
        num_prompt_tokens=len(params.token_ids or ()),
        num_stop_strings=len(params.stop),
        num_stop_token_ids=len(params.stop_token_ids),
        num_tools=len(params.tools),
        num_bad_words=len(params.bad_words) + len(params.bad_word_ids),
        num_allowed_token_ids=len(params.allowed_token_ids),
    )
    if params.messages is not None:
        params = with_tool_constraint(params)
    _check_sampling(params, limits)
    num_inputs = sum(x is not None for x in (params.text, params.token_ids, params.messages))
    if num_inputs != 1:
        raise invalid("exactly one of a text prompt, token ids or messages is required", "prompt")
    if params.text is not None:
        if len(params.text) > limits.max_prompt_chars:
            raise invalid(
                f"the prompt has {len(params.text)} characters; at most "
                f"{limits.max_prompt_chars} are accepted",
                "prompt",
            )
        check_text(params.text, "prompt")
    if params.token_ids is not None and any(
        not 0 <= token_id <= MAX_UINT32 for token_id in params.token_ids
    ):
        raise invalid("prompt token ids must be token ids (>= 0)", "prompt")
    if params.messages is not None:
        return _check_chat(params, limits)
    if params.tools or params.tool_choice is not None:
        raise invalid("tools need chat messages", "tools")
    return params
