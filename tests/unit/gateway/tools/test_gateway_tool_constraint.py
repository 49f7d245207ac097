"""The constraints a forced tool_choice builds, compiled by llguidance (the engine's library):
they accept exactly valid calls, and whatever they let a model write, the gateway reads as
valid calls (a random walk over what the constraint allows stands in for a weak model)."""

from __future__ import annotations

import json
import random
from typing import NamedTuple

import jsonschema
import llguidance
import llguidance.hf
import pytest
import tokenizers
from support.gateway_fakes import EOS_TOKEN, EOS_TOKEN_ID, tokenizer_json
from transformers import PreTrainedTokenizerFast

from pdserve.common.generation import Constraint, FinishReason
from pdserve.gateway.request import OutputDelta
from pdserve.gateway.tool_deltas import ToolCallStream
from pdserve.gateway.tools.formats import FORMATS, HERMES
from pdserve.gateway.tools.plan import ToolPlan, forced_call_constraint, plan_tools
from pdserve.gateway.tools.spec import FunctionTool, ToolChoice, ToolChoiceMode

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
NOTHING = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = (
    FunctionTool("get_weather", "Weather.", json.dumps(WEATHER)),
    FunctionTool("get_time", parameters=json.dumps(NOTHING)),
)
SCHEMAS = {"get_weather": WEATHER, "get_time": NOTHING}
CLOSERS = frozenset(b'"}],0123456789CF')


@pytest.fixture(scope="module")
def tokenizer() -> llguidance.LLTokenizer:
    backend = tokenizers.Tokenizer.from_str(tokenizer_json())
    return llguidance.hf.from_tokenizer(
        PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN)
    )


class Forced(NamedTuple):
    """A forced tool_choice's parser plan and constraint."""

    plan: ToolPlan
    constraint: Constraint


def _forced(
    choice: ToolChoice, is_parallel: bool = True, tools: tuple[FunctionTool, ...] = TOOLS
) -> Forced:
    plan = plan_tools(tools, choice, FORMATS[HERMES])
    constraint = forced_call_constraint(tools, choice, is_parallel)
    assert plan is not None and constraint is not None
    return Forced(plan, constraint)


def _matcher(tokenizer: llguidance.LLTokenizer, forced: Forced) -> llguidance.LLMatcher:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(forced.constraint.value)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""  # no error
    return llguidance.LLMatcher(tokenizer, grammar)


def _accepts(tokenizer: llguidance.LLTokenizer, forced: Forced, text: str) -> bool:
    matcher = _matcher(tokenizer, forced)
    return bool(matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting())


def _read(plan: ToolPlan, text: str) -> list[tuple[str, str]]:
    stream = ToolCallStream(plan)
    delta = stream.step(OutputDelta(text, (), 0, FinishReason.STOP))
    calls: dict[int, list[str]] = {}
    for step in delta.tool_calls:
        calls.setdefault(step.index, [step.name or "", ""])[1] += step.arguments
    return [(name, arguments) for name, arguments in calls.values()]


REQUIRED = ToolChoice(ToolChoiceMode.REQUIRED)
NAMED = ToolChoice(ToolChoiceMode.FUNCTION, "get_weather")
GOOD_WEATHER = '{"city": "Paris", "unit": "C"}'


@pytest.mark.parametrize(
    ("choice", "is_parallel", "text", "is_valid"),
    [
        (REQUIRED, True, f'[{{"name": "get_weather", "arguments": {GOOD_WEATHER}}}]', True),
        (
            REQUIRED,
            True,
            f'[{{"name": "get_time", "arguments": {{}}}}, '
            f'{{"name": "get_weather", "arguments": {GOOD_WEATHER}}}]',
            True,
        ),
        (
            REQUIRED,
            False,
            '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]',
            False,
        ),
        (REQUIRED, True, "[]", False),
        (REQUIRED, True, '[{"name":"get_time","arguments":{}}]', False),  # layout
        (REQUIRED, True, '[{"name": "rm", "arguments": {}}]', False),
        (REQUIRED, True, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', False),
        (REQUIRED, True, "I would rather chat.", False),
        (NAMED, True, GOOD_WEATHER, True),
        (NAMED, True, '{"city": "Paris", "unit": "K"}', False),
        (NAMED, True, '{"name": "get_weather", "arguments": {}}', False),
    ],
)
def test_the_constraint_accepts_valid_calls_only(
    tokenizer: llguidance.LLTokenizer,
    choice: ToolChoice,
    is_parallel: bool,
    text: str,
    is_valid: bool,
) -> None:
    assert _accepts(tokenizer, _forced(choice, is_parallel), text) is is_valid


@pytest.mark.parametrize("choice", [REQUIRED, NAMED], ids=["required", "named"])
@pytest.mark.parametrize("is_parallel", [True, False])
def test_whatever_the_constraint_allows_reads_as_valid_calls(
    tokenizer: llguidance.LLTokenizer, choice: ToolChoice, is_parallel: bool
) -> None:
    forced = _forced(choice, is_parallel)
    rng = random.Random(7)
    for _ in range(20):
        matcher = _matcher(tokenizer, forced)
        text = b""
        for _ in range(600):
            mask = matcher.compute_logit_bias()  # one byte per token: 200 allowed, 0 not
            allowed = [t for t, bias in enumerate(mask) if bias]
            closers = [t for t in allowed if t in CLOSERS or t == EOS_TOKEN_ID]
            token = rng.choice(closers if closers and rng.random() < 0.6 else allowed)
            if token == EOS_TOKEN_ID:
                break
            assert matcher.consume_token(token)
            text += bytes([token])
        assert matcher.is_accepting(), text
        calls = _read(forced.plan, text.decode())
        assert calls
        if not is_parallel or choice is NAMED:
            assert len(calls) == 1
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_references_inside_a_schema_still_resolve_in_the_list_of_calls(
    tokenizer: llguidance.LLTokenizer,
) -> None:
    # NOTE: as pydantic writes schemas: definitions in $defs, references to them, recursion.
    place = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "near": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]},
        },
        "required": ["city"],
        "additionalProperties": False,
    }
    trip = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$defs": {"Place": place, "Unit": {"enum": ["C", "F"]}},
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["place", "unit"],
        "additionalProperties": False,
    }
    forced = _forced(
        REQUIRED, tools=(FunctionTool("plan_trip", parameters=json.dumps(trip)), *TOOLS)
    )
    arguments = '{"place": {"city": "Paris", "near": {"city": "Lyon", "near": null}}, "unit": "C"}'
    good = f'[{{"name": "plan_trip", "arguments": {arguments}}}]'
    assert _accepts(tokenizer, forced, good)
    assert not _accepts(tokenizer, forced, good.replace('"C"', '"K"'))
    assert not _accepts(tokenizer, forced, good.replace('"near": null', '"near": 3'))
    jsonschema.validate(json.loads(good), json.loads(forced.constraint.value))
    assert _read(forced.plan, good) == [("plan_trip", arguments)]
