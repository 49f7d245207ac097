"""A chat message's content at the edge: a string or a list of text parts (joined), and a
part of any other type (an image, audio) refused by its place and type, not by the union's
shapes it failed to match."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.openai.parsing import parse_openai_body
from pdserve.gateway.prepare.validation import RequestLimits
from pdserve.gateway.request import ApiKind

IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}


def parse(messages: list[dict[str, Any]]) -> Any:
    raw = json.dumps({"model": "m", "messages": messages}).encode()
    return parse_openai_body(raw, ApiKind.CHAT, RequestLimits()).params[0]


def refusal(messages: list[dict[str, Any]]) -> PdserveError:
    with pytest.raises(PdserveError) as raised:
        parse(messages)
    assert raised.value.reason is ErrorReason.INVALID_REQUEST
    return raised.value


def test_text_parts_are_joined_in_order() -> None:
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    params = parse([{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}])
    assert [m.content for m in params.messages] == ["Be brief.", "Hello, world"]


@pytest.mark.parametrize(("part", "kind"), [(IMAGE, "image_url"), (AUDIO, "input_audio")])
def test_a_part_that_is_not_text_is_refused_by_place_and_type(
    part: dict[str, Any], kind: str
) -> None:
    content = [{"type": "text", "text": "what is this?"}, part]
    error = refusal([{"role": "user", "content": "hi"}, {"role": "user", "content": content}])
    assert error.message == f"content parts of type {kind!r} are not supported (text only)"
    assert error.metadata["param"] == "messages[1].content[1]"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"type": "text"}], "messages.0.content.0.text: Field required"),
        ([{"type": "text", "text": 3}],
         "messages.0.content.0.text: Input should be a valid string"),
        ([{"type": "text", "text": "x", "extra": 1}], "unrecognized request argument: "
         "messages.0.content.0.extra"),
        (7, "messages.0.content: Input should be a valid array"),
    ],
)  # fmt: skip
def test_a_malformed_part_names_its_own_field(content: Any, message: str) -> None:
    assert refusal([{"role": "user", "content": content}]).message == message


def test_an_assistant_message_of_tool_calls_needs_no_content() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    params = parse(
        [
            {"role": "user", "content": "call f"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]},
        ]
    )
    assert params.messages[1].content is None
    assert params.messages[2].content == "ok"
