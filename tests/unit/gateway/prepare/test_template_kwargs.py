"""``chat_template_kwargs`` on a chat completion reach the chat template (Qwen3's
``enable_thinking`` switch), and may not replace what the request itself gives it."""

from __future__ import annotations

from typing import Any

import pytest
from support.gateway_fakes import tokenizer_json

from pdserve.common.errors import PdserveError
from pdserve.gateway.openai.schemas import ChatCompletionRequest
from pdserve.gateway.prepare.tokenize import tokenize_prompt
from pdserve.gateway.tools.formats import HERMES
from pdserve.tokenizer import Tokenizer

# NOTE: how Qwen3's template closes an empty think block when thinking is switched off.
TEMPLATE = (
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
