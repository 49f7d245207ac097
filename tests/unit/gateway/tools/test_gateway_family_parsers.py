"""The families' own chat formats read from completions: gpt-oss's harmony (reasoning on the
analysis channel, the answer on final, calls as commentary messages to functions) and
DeepSeek-V3's tool-call markers. Each case reads the same whole, a character at a time, in
two pieces at every boundary and in random pieces; no markup reaches the content."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.generation import FinishReason
from pdserve.gateway.request import OutputDelta
from pdserve.gateway.tool_deltas import ToolCallStream
from pdserve.gateway.tools import deepseek, harmony
from pdserve.gateway.tools.formats import (
    DEEPSEEK_V3,
    FORMATS,
    HARMONY,
    HERMES,
    LLAMA3_JSON,
    resolve_format,
)
from pdserve.gateway.tools.plan import ToolPlan, plan_tools
from pdserve.gateway.tools.spec import FunctionTool, ToolCall, ToolChoice, ToolChoiceMode

NAMES = frozenset({"get_weather", "get_time"})
WEATHER = '{"city": "Zürich 🌧", "days": 2}'
# NOTE: markup inside a string is not: a model writes a marker as its one token, and the text
# cannot tell that token from the characters (the parsers read text), so none is in here.
TRICKY = '{"q": "a \\"}\\" b <| ```", "list": [1, {"x": "]"}], "n": null}'

# harmony: the completion starts after the prompt's "<|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Use the tool.<|end|>"
H_CALL = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    f"<|message|>{WEATHER}<|call|>"
)
H_FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Zürich.<|return|>"

# DeepSeek-V3, with its tokenizer's own markers
B, E = deepseek.CALLS_BEGIN, deepseek.CALLS_END
CB, CE, SEP = deepseek.CALL_BEGIN, deepseek.CALL_END, deepseek.SEP


def ds_call(name: str, arguments: str) -> str:
    return f"{CB}function{SEP}{name}\n```json\n{arguments}\n```{CE}"


@dataclass(frozen=True)
class Case:
    """A completion and what must be read from it."""

    name: str
    format: str
    text: str
    content: str | None
    calls: list[tuple[str, str]]
    reasoning: str = ""
    finish_reason: str = "stop"
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    shows_reasoning: bool = True


CASES = [
    Case(
        "harmony_reasoning_then_answer",
        HARMONY,
        ANALYSIS + H_FINAL,
        "It is sunny in Zürich.",
        [],
        reasoning="The user wants the weather. Use the tool.",
    ),
    Case(
        "harmony_reasoning_then_call",
        HARMONY,
        ANALYSIS + H_CALL,
        None,
        [("get_weather", WEATHER)],
        reasoning="The user wants the weather. Use the tool.",
        finish_reason="tool_calls",
    ),
    Case(
        "harmony_recipient_after_the_channel",
        HARMONY,
        f"<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{TRICKY}<|call|>",
        None,
        [("get_time", TRICKY)],
        finish_reason="tool_calls",
    ),
    Case(
        "harmony_preamble_and_two_calls",
        HARMONY,
        "<|channel|>commentary<|message|>Checking both.<|end|>"
        + H_CALL.replace("<|call|>", "<|end|>")
        + "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
        "Checking both.",
        [("get_weather", WEATHER), ("get_time", "{}")],
        finish_reason="tool_calls",
    ),
    Case(
        "harmony_call_of_a_function_not_offered_is_content",
        HARMONY,
        "<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}<|call|>",
        "{}",
        [],
    ),
    Case(
        "harmony_reasoning_not_shown_is_left_out",
        HARMONY,
        ANALYSIS + H_FINAL,
        "It is sunny in Zürich.",
        [],
        shows_reasoning=False,
    ),
    Case(
        "harmony_answer_without_reasoning",
        HARMONY,
        "<|channel|>final<|message|>Hi <there> <|e<|return|>",
        "Hi <there> <|e",
        [],
    ),
    Case("harmony_no_markup_is_content", HARMONY, "Just text.", "Just text.", []),
    Case(
        "harmony_cut_in_the_analysis",
        HARMONY,
        "<|channel|>analysis<|message|>Hmm <|",
        "",
        [],
        reasoning="Hmm <|",
    ),
    Case(
        "deepseek_text_then_calls",
        DEEPSEEK_V3,
        f"Let me check.{B}{ds_call('get_weather', WEATHER)}\n{ds_call('get_time', '{}')}{E}",
        "Let me check.",
        [("get_weather", WEATHER), ("get_time", "{}")],
        finish_reason="tool_calls",
    ),
    Case(
        "deepseek_tricky_arguments",
        DEEPSEEK_V3,
        f"{B}{ds_call('get_time', TRICKY)}{E}",
        None,
        [("get_time", TRICKY)],
        finish_reason="tool_calls",
    ),
    Case(
        "deepseek_v3_1_name_before_the_separator",
        DEEPSEEK_V3,
        f"{B}{CB}get_weather{SEP}{WEATHER}{CE}{E}",
        None,
        [("get_weather", WEATHER)],
        finish_reason="tool_calls",
    ),
    Case(
        "deepseek_text_after_the_calls",
        DEEPSEEK_V3,
        f"{B}{ds_call('get_time', '{}')}{E} Done.",
        "Done.",
        [("get_time", "{}")],
        finish_reason="tool_calls",
    ),
    Case(
        "deepseek_function_not_offered_stays_content",
        DEEPSEEK_V3,
        f"{B}{ds_call('launch', '{}')}{E}",
        ds_call("launch", "{}"),
        [],
    ),
    Case(
        "deepseek_broken_markup_stays_content",
        DEEPSEEK_V3,
        f"{B}{CB}function{SEP}get_time\nnot json{CE}{E}",
        f"{CB}function{SEP}get_time\nnot json{CE}{E}",  # as written, from the broken call on
        [],
    ),
    Case("deepseek_text_only", DEEPSEEK_V3, "Hello <｜tool", "Hello <｜tool", []),
]


def _plan(case: Case) -> ToolPlan:
    return ToolPlan(FORMATS[case.format], case.mode, NAMES, shows_reasoning=case.shows_reasoning)


def _read(
    case: Case, pieces: list[str]
) -> tuple[str | None, list[tuple[str, str]], str, str, list]:
    """(content, calls, reasoning, finish reason, every delta) of `pieces` streamed."""
    stream = ToolCallStream(_plan(case))
    deltas = [stream.step(OutputDelta(piece, (), 0)) for piece in pieces]
    deltas.append(stream.step(OutputDelta("", (), 0, FinishReason.STOP)))
    content = "".join(d.text for d in deltas)
    calls: dict[int, list[str]] = {}
    for step in (s for d in deltas for s in d.tool_calls):
        if step.id is not None:
            assert step.index == len(calls)
            calls[step.index] = [step.name or "", ""]
        calls[step.index][1] += step.arguments
    reason = deltas[-1].finish_reason
    assert reason is not None
    reasoning = "".join(d.reasoning for d in deltas)
    content_or_none = content if content or not calls else None
    return content_or_none, [(n, a) for n, a in calls.values()], reasoning, reason.value, deltas


def _check(case: Case, pieces: list[str]) -> None:
    content, calls, reasoning, reason, deltas = _read(case, pieces)
    assert (content, calls, reasoning, reason) == (
        case.content,
        case.calls,
        case.reasoning,
        case.finish_reason,
    ), pieces
    markup = harmony.MARKUP_TOKENS if case.format == HARMONY else deepseek.MARKUP_TOKENS
    if not any(m in (case.content or "") for m in markup):
        assert not any(m in d.text for d in deltas for m in markup), pieces
    for _, arguments in calls:
        json.loads(arguments)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reads_the_same_however_the_text_is_split(case: Case) -> None:
    text = case.text
    _check(case, [text])
    _check(case, list(text))
    for i in range(1, len(text)):
        _check(case, [text[:i], text[i:]])


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_reads_the_same_in_random_pieces(case: Case, data: st.DataObject) -> None:
    text = case.text
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    _check(case, [text[a:b] for a, b in itertools.pairwise(bounds) if b > a])


def test_harmony_arguments_and_reasoning_stream_while_written() -> None:
    stream = ToolCallStream(_plan(CASES[1]))
    text = ANALYSIS + H_CALL
    first = stream.step(OutputDelta(text[: text.index("Use the")], (), 0))
    assert first.reasoning == "The user wants the weather. "
    second = stream.step(OutputDelta(text[text.index("Use the") : text.index('"days"')], (), 0))
    [step] = second.tool_calls
    assert (step.index, step.name) == (0, "get_weather")
    assert step.arguments == WEATHER[: WEATHER.index('"days"')]


def test_deepseek_arguments_stream_while_written() -> None:
    case = CASES[-7]
    stream = ToolCallStream(_plan(case))
    first = stream.step(OutputDelta(case.text[: case.text.index('"days"')], (), 0))
    assert first.text == "Let me check."
    [step] = first.tool_calls
    assert (step.name, step.arguments) == ("get_weather", WEATHER[: WEATHER.index('"days"')])


def test_a_required_call_of_a_harmony_model_is_read_as_constrained() -> None:
    plan = ToolPlan(FORMATS[HARMONY], ToolChoiceMode.REQUIRED, NAMES)
    stream = ToolCallStream(plan)
    last = stream.step(
        OutputDelta('[{"name": "get_time", "arguments": {}}]', (), 0, FinishReason.STOP)
    )
    assert [(c.name, c.arguments) for c in last.tool_calls] == [("get_time", "{}")]


@pytest.mark.parametrize("format_name", [HARMONY, DEEPSEEK_V3])
def test_calls_the_fallback_writes_read_back_as_the_same_calls(format_name: str) -> None:
    calls = [ToolCall("call_1", "get_weather", WEATHER), ToolCall("call_2", "get_time", "{}")]
    text = FORMATS[format_name].calls_text(calls)
    stream = ToolCallStream(ToolPlan(FORMATS[format_name], ToolChoiceMode.AUTO, NAMES))
    if format_name == HARMONY:
        text = "<|channel|>analysis<|message|>x<|end|>" + text
    read = stream.step(OutputDelta(text, (), 0, FinishReason.STOP))
    assert [(c.name, c.arguments) for c in read.tool_calls] == [
        ("get_weather", WEATHER),
        ("get_time", "{}"),
    ]
    assert "get_weather" in FORMATS[format_name].tools_prompt((FunctionTool("get_weather"),))


def test_a_harmony_chat_is_read_without_tools_and_other_formats_are_not() -> None:
    plan = plan_tools((), None, FORMATS[HARMONY], is_chat=True, shows_reasoning=True)
    assert plan is not None and plan.mode is ToolChoiceMode.NONE and not plan.names
    assert plan_tools((), None, FORMATS[HARMONY]) is None  # a completion request: raw text
    assert plan_tools((), None, FORMATS[DEEPSEEK_V3], is_chat=True) is None
    tools = (FunctionTool("get_time"),)
    none = plan_tools(tools, ToolChoice(ToolChoiceMode.NONE), FORMATS[HARMONY], is_chat=True)
    assert none is not None and not none.names  # tool_choice none: no message is a call


GPT_OSS_TEMPLATE_EXCERPT = (
    "{%- for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}"
    "<|end|>{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
DEEPSEEK_TEMPLATE_EXCERPT = (
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
    "'<｜tool▁sep｜>' + tool['function']['name']}}"
)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        (GPT_OSS_TEMPLATE_EXCERPT, HARMONY),
        (DEEPSEEK_TEMPLATE_EXCERPT, DEEPSEEK_V3),
        ("{{ '<|python_tag|>' }}{{ messages }}", LLAMA3_JSON),
        ("<|channel|> alone {{ messages }}", HERMES),
        (None, HERMES),
    ],
)
def test_auto_picks_the_family_format_from_the_chat_template(
    template: str | None, parser: str
) -> None:
    assert resolve_format("auto", template).name == parser
    assert resolve_format(DEEPSEEK_V3, template).name == DEEPSEEK_V3
