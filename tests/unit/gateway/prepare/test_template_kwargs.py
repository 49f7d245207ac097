"""``chat_template_kwargs`` on a chat completion reach the chat template (Qwen3's
``enable_thinking`` switch), and may not replace what the request itself gives it; so does
``reasoning_effort`` (gpt-oss's template reads it), and Responses' ``reasoning.effort``."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from support.gateway_fakes import tokenizer_json

from pdserve.common.errors import PdserveError
from pdserve.gateway.openai.responses_api.convert import parse_responses_body
from pdserve.gateway.openai.schemas import ChatCompletionRequest
from pdserve.gateway.prepare.tokenize import tokenize_prompt
from pdserve.gateway.prepare.validation import RequestLimits
from pdserve.gateway.tools.formats import HERMES
from pdserve.tokenizer import Tokenizer

# NOTE: how Qwen3's template closes an empty think block when thinking is switched off.
TEMPLATE = (
    "{% if reasoning_effort is defined %}[effort {{ reasoning_effort }}]{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}"
)


def rendered(body: dict[str, Any]) -> str:
    tokenizer = Tokenizer(tokenizer_json(), chat_template=TEMPLATE)
    (params,) = ChatCompletionRequest.model_validate(body).to_params()
    return tokenizer.decode(tokenize_prompt(params, tokenizer, HERMES), skip_special_tokens=False)


BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_enable_thinking_false_reaches_the_template() -> None:
    assert "</think>" not in rendered(BODY)
    off = rendered({**BODY, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<think>\n\n</think>\n\n")


def test_a_kwarg_that_would_replace_the_requests_own_input_is_refused() -> None:
    with pytest.raises(PdserveError, match="messages is set by the request itself"):
        rendered({**BODY, "chat_template_kwargs": {"messages": []}})


def test_reasoning_effort_reaches_the_template() -> None:
    assert "[effort" not in rendered(BODY)
    assert rendered({**BODY, "reasoning_effort": "low"}).startswith("[effort low]")
    both = {
        **BODY,
        "reasoning_effort": "high",
        "chat_template_kwargs": {"reasoning_effort": "high"},
    }
    assert rendered(both).startswith("[effort high]")
    assert rendered({**BODY, "chat_template_kwargs": {"reasoning_effort": "max"}}).startswith(
        "[effort max]"
    )


def test_a_reasoning_effort_that_differs_from_the_kwargs_or_is_unknown_is_refused() -> None:
    differ = {
        **BODY,
        "reasoning_effort": "low",
        "chat_template_kwargs": {"reasoning_effort": "high"},
    }
    with pytest.raises(PdserveError, match="reasoning_effort and chat_template_kwargs") as caught:
        rendered(differ)
    assert caught.value.metadata["param"] == "reasoning_effort"
    with pytest.raises(pydantic.ValidationError, match="reasoning_effort"):
        rendered({**BODY, "reasoning_effort": "extreme"})


def test_responses_reasoning_effort_reaches_the_params_and_other_settings_are_refused() -> None:
    def parsed(reasoning: Any) -> Any:
        body = {"model": "m", "input": "hi", "reasoning": reasoning}
        return parse_responses_body(json.dumps(body).encode(), RequestLimits())

    body = parsed({"effort": "low", "summary": "auto"})
    assert dict(body.params.template_variables) == {"reasoning_effort": "low"}
    assert body.echoed["reasoning"] == {"effort": "low", "summary": None}
    assert parsed({}).params.template_variables == ()
    assert parsed(None).echoed["reasoning"] == {"effort": None, "summary": None}
    for refused, path in (
        ({"summary": "detailed"}, "reasoning.summary"),
        ({"effort": "extreme"}, "reasoning.effort"),
        ({"mode": "pro"}, "reasoning.mode"),
    ):
        with pytest.raises(PdserveError) as caught:
            parsed(refused)
        assert caught.value.metadata["param"] == "reasoning"
        assert path in caught.value.message, caught.value
