"""Tool calls read from completions, whole and split at every character boundary: the same
content and calls however the text arrives, and no call markup in the content."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import pytest

from pdserve.common.generation import FinishReason
from pdserve.gateway.request import OutputDelta
from pdserve.gateway.tool_deltas import ToolCallStream
from pdserve.gateway.tools.formats import FORMATS, HERMES, LLAMA3_JSON, resolve_format
from pdserve.gateway.tools.plan import ToolPlan
from pdserve.gateway.tools.spec import ToolChoiceMode

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = '{"city": "Zürich 🌧", "days": 2}'
TRICKY = '{"q": "a \\"}\\" b <tool_call>", "list": [1, {"x": "]"}], "n": null}'
CALL = f'{{"name": "get_weather", "arguments": {WEATHER}}}'
TIME = '{"name": "get_time", "arguments": {}}'


@dataclass(frozen=True)
class Case:
    """A completion and what must be read from it."""

    name: str
    text: str
    content: str | None
    calls: list[tuple[str, str]]
    format: str = HERMES
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    finish_reason: str = "stop"


CASES = [
    Case("hermes_text_only", "Hello <there> <tool", "Hello <there> <tool", []),
    Case(
        "hermes_text_then_call",
        f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>",
        "Let me check.",
        [("get_weather", WEATHER)],
        finish_reason="tool_calls",
    ),
    Case(
        "hermes_two_tags",
        f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
        None,
        [("get_weather", WEATHER), ("get_time", "{}")],
        finish_reason="tool_calls",
    ),
    Case(
        "hermes_list_in_one_tag",
        f"<tool_call>[{CALL}, {TIME}]</tool_call>",
        None,
        [("get_weather", WEATHER), ("get_time", "{}")],
        finish_reason="tool_calls",
    ),
    Case(
        "hermes_arguments_before_name",
        f'<tool_call>{{"arguments": {TRICKY}, "name": "get_time"}}</tool_call>',
        None,
        [("get_time", TRICKY)],
        finish_reason="tool_calls",
    ),
    Case(
        "hermes_strings_with_brackets",
        f'<tool_call>{{"name": "get_time", "arguments": {TRICKY}}}</tool_call>',
        None,
        [("get_time", TRICKY)],
        finish_reason="tool_calls",
    ),
    Case(
        "hermes_quoted_arguments",
        '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>',
        None,
        [("get_time", '{"tz": "UTC"}')],
        finish_reason="tool_calls",
    ),
    Case(
        "hermes_no_arguments",
        '<tool_call>{"name": "get_time"}</tool_call>',
        None,
        [("get_time", "{}")],
        finish_reason="tool_calls",
    ),
    Case(
        "hermes_first_arguments_key_wins",
        '<tool_call>{"name": "get_time", "arguments": {"a": 1}, "arguments": {"b": 2}}</tool_call>',
        None,
        [("get_time", '{"a": 1}')],
        finish_reason="tool_calls",
    ),
    Case(
        "hermes_text_after_call",
        f"<tool_call>{TIME}</tool_call>\n\nDone, see above.",
        "Done, see above.",
        [("get_time", "{}")],
        finish_reason="tool_calls",
    ),
    Case(
        "hermes_unknown_function_stays_text",
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call> ok',
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call> ok',
        [],
    ),
    Case(
        "hermes_not_json_stays_text",
        "a <tool_call>not json</tool_call> b",
        "a <tool_call>not json</tool_call> b",
        [],
    ),
    Case(
        "hermes_unclosed_tag",
        f"<tool_call>\n{CALL}",
        None,
        [("get_weather", WEATHER)],
        finish_reason="tool_calls",
    ),
    Case(
        "hermes_unclosed_object_stays_text",
        '<tool_call>{"nam',
        '<tool_call>{"nam',
        [],
    ),
    Case(
        "llama3_call",
        '{"name": "get_weather", "parameters": ' + WEATHER + "}",
        None,
        [("get_weather", WEATHER)],
        format=LLAMA3_JSON,
        finish_reason="tool_calls",
    ),
    Case(
        "llama3_python_tag_and_two_calls",
        '<|python_tag|>{"name": "get_time", "parameters": {}}; '
        '{"name": "get_weather", "parameters": ' + WEATHER + "}",
        None,
        [("get_time", "{}"), ("get_weather", WEATHER)],
        format=LLAMA3_JSON,
        finish_reason="tool_calls",
    ),
    Case("llama3_text", "It is 4 {not a call}.", "It is 4 {not a call}.", [], format=LLAMA3_JSON),
    Case("llama3_other_json", ' {"answer": 4}', '{"answer": 4}', [], format=LLAMA3_JSON),
    Case(
        "llama3_call_then_text",
        '{"name": "get_time", "parameters": {}} Then I answer.',
        "Then I answer.",
        [("get_time", "{}")],
        format=LLAMA3_JSON,
        finish_reason="tool_calls",
    ),
    Case(
        "required_list",
        f"[{CALL}, {TIME}]",
        None,
        [("get_weather", WEATHER), ("get_time", "{}")],
        mode=ToolChoiceMode.REQUIRED,
        finish_reason="tool_calls",
    ),
    Case(
        "required_unconstrained_hermes",
        f"Sure. <tool_call>{TIME}</tool_call>",
        "Sure.",
        [("get_time", "{}")],
        mode=ToolChoiceMode.REQUIRED,
        finish_reason="tool_calls",
    ),
    Case(
        "named_arguments",
        WEATHER,
        None,
        [("get_weather", WEATHER)],
        mode=ToolChoiceMode.FUNCTION,
    ),
    Case(
        "named_unconstrained_hermes",
        f"<tool_call>{CALL}</tool_call>",
        None,
        [("get_weather", WEATHER)],
        mode=ToolChoiceMode.FUNCTION,
    ),
]


def _plan(case: Case) -> ToolPlan:
    function = "get_weather" if case.mode is ToolChoiceMode.FUNCTION else None
    return ToolPlan(FORMATS[case.format], case.mode, NAMES, function)


def _read(case: Case, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], str, list]:
    """(content, calls, finish reason, every delta) of the completion sent in `pieces`."""
    stream = ToolCallStream(_plan(case))
    deltas = [stream.step(OutputDelta(piece, (), 0)) for piece in pieces]
    deltas.append(stream.step(OutputDelta("", (), 0, FinishReason.STOP)))
    content = "".join(d.text for d in deltas)
    calls: dict[int, list[str]] = {}
    for step in (s for d in deltas for s in d.tool_calls):
        if step.id is not None:
            assert step.index == len(calls)  # ids and names come first, once per call
            calls[step.index] = [step.name or "", ""]
        calls[step.index][1] += step.arguments
    reason = deltas[-1].finish_reason
    assert reason is not None
    content_or_none = content if content or not calls else None
    return content_or_none, [(n, a) for n, a in calls.values()], reason.value, deltas


def _splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and in two pieces at every boundary."""
    return [[text], list(text), *([text[:i], text[i:]] for i in range(1, len(text)))]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reads_the_same_however_the_text_is_split(case: Case) -> None:
    for pieces in _splits(case.text):
        content, calls, reason, deltas = _read(case, pieces)
        assert (content, calls, reason) == (case.content, case.calls, case.finish_reason), pieces
        if case.calls and "<tool_call>" not in (case.content or ""):
            assert all("tool_call>" not in d.text for d in deltas), pieces
        for name, arguments in calls:
            assert arguments == "{}" or json.loads(arguments) == json.loads(dict(case.calls)[name])


def test_three_way_splits_of_a_call_read_the_same() -> None:
    case = CASES[1]
    text = case.text
    for i, j in itertools.combinations(range(1, len(text)), 2):
        content, calls, _, _ = _read(case, [text[:i], text[i:j], text[j:]])
        assert (content, calls) == (case.content, case.calls), (i, j)


def test_arguments_stream_while_the_call_is_written() -> None:
    case = CASES[1]
    text = case.text
    stream = ToolCallStream(_plan(case))
    cut = text.index('"days"')
    first = stream.step(OutputDelta(text[:cut], (), 0))
    [step] = first.tool_calls
    assert (step.index, step.name) == (0, "get_weather")
    assert step.arguments == WEATHER[: WEATHER.index('"days"')]


def test_the_length_cut_leaves_the_call_as_far_as_it_got() -> None:
    case = CASES[1]
    stream = ToolCallStream(_plan(case))
    text = case.text[: case.text.index("2}")]
    last = stream.step(OutputDelta(text, (), 0, FinishReason.LENGTH))
    assert last.finish_reason is FinishReason.LENGTH
    assert last.tool_calls[0].arguments == WEATHER[: WEATHER.index("2}")]


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{{ messages }}", HERMES),
        ("{{ '<|python_tag|>' }}{{ messages }}", LLAMA3_JSON),
        (
            'Respond in the format {"name": function name, "parameters": dictionary of argument '
            "name and its value}",
            LLAMA3_JSON,
        ),
        (None, HERMES),
    ],
)
def test_auto_picks_the_format_from_the_chat_template(template: str | None, parser: str) -> None:
    assert resolve_format("auto", template).name == parser
    assert resolve_format(HERMES, template).name == HERMES
