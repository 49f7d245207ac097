"""A value out of range is refused with the range a client can act on: the limits pdserve
sets, not the wire format's (a temperature below 0 is told ">= 0", not "[0, 3.4e+38]")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.openai.parsing import parse_openai_body
from pdserve.gateway.prepare.validation import RequestLimits
from pdserve.gateway.request import ApiKind


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"temperature": -1}, "temperature must be >= 0"),
        ({"temperature": 1e39}, "temperature must be in [0, 3.40282e+38]"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"max_completion_tokens": 0}, "max_completion_tokens must be >= 1"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"n": 17}, "n must be in [1, 16]"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs must be in [0, 20]"),
    ],
)
def test_the_message_quotes_the_limits_a_client_can_meet(
    body: dict[str, Any], message: str
) -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    with pytest.raises(PdserveError) as raised:
        parse_openai_body(raw.encode(), ApiKind.CHAT, RequestLimits())
    assert raised.value.reason is ErrorReason.INVALID_REQUEST
    assert raised.value.message == message
    assert raised.value.metadata["param"] == next(iter(body))


def test_a_configured_max_tokens_limit_is_quoted() -> None:
    raw = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 99})
    with pytest.raises(PdserveError, match=r"max_tokens must be in \[1, 64\]"):
        parse_openai_body(raw.encode(), ApiKind.COMPLETIONS, RequestLimits(max_tokens_limit=64))
