"""What a request's tools mean for its generation: `forced_call_constraint` is the constraint
a forced tool_choice puts on the completion (the validator sets it, as for any constraint), and
`plan_tools` decides, from the tools, the tool_choice and the model's call format, which parser
reads the completion back.

* ``auto``: no constraint; the model's format parser (``--tool-call-parser``) reads calls from
  its free text.
* ``required``: a JSON Schema constraint makes the completion a list of calls,
  ``[{"name": <an offered function>, "arguments": <that function's parameters schema>}, ...]``
  (exactly one with ``parallel_tool_calls: false``).
* a named function: a JSON Schema constraint makes the completion that function's arguments
  (its parameters schema); the call's name is known up front.
* ``none``: no constraint and no parser: the completion is content. A harmony chat (gpt-oss)
  is read all the same (a plan of mode NONE, with no function to call), since its answer and
  reasoning are on channels.

Both schemas carry llguidance's ``x-guidance`` layout (compact JSON with a space after ``,``
and ``:``), unless the function's own schema sets one.

A constrained completion is read as the constraint shapes it, and otherwise by the model's
format parser (an engine that did not apply the constraint).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.common.generation import Constraint, ConstraintKind
from pdserve.gateway.tools.deepseek import DeepSeekParser
from pdserve.gateway.tools.formats import DEEPSEEK_V3, HARMONY, LLAMA3_JSON, ToolCallFormat
from pdserve.gateway.tools.harmony import HarmonyParser
from pdserve.gateway.tools.parsers import (
    ArgumentsParser,
    HermesParser,
    JsonCallsParser,
    ToolCallParser,
)
from pdserve.gateway.tools.spec import FunctionTool, ToolChoice, ToolChoiceMode


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tool calls are made and read.

    Attributes:
        format: The model's call format.
        mode: The resolved tool_choice (NONE only for a format that reads every chat:
            harmony's channels, with no function to call).
        names: The functions offered.
        function_name: The function a named tool_choice forces.
        shows_reasoning: The format's parser gives the reasoning it reads (harmony's
            analysis channel) as reasoning; else it leaves it out.
    """

    format: ToolCallFormat
    mode: ToolChoiceMode
    names: frozenset[str]
    function_name: str | None = None
    shows_reasoning: bool = False

    @property
    def is_named(self) -> bool:
        """Whether tool_choice names the function (its completion ends with ``stop``)."""
        return self.mode is ToolChoiceMode.FUNCTION

    def new_parser(self) -> ToolCallParser:
        """A parser for one completion of the request."""
        own = self._format_parser()
        if self.mode is ToolChoiceMode.REQUIRED:
            return JsonCallsParser(("arguments",), self.names, fallback=own)
        if self.mode is ToolChoiceMode.FUNCTION:
            assert self.function_name is not None
            return ArgumentsParser(self.function_name, fallback=own)
        return own

    def _format_parser(self) -> ToolCallParser:
        if self.format.name == LLAMA3_JSON:
            return JsonCallsParser(self.format.arguments_keys, self.names)
        if self.format.name == HARMONY:
            return HarmonyParser(self.names, self.shows_reasoning)
        if self.format.name == DEEPSEEK_V3:
            return DeepSeekParser(self.names)
        return HermesParser(self.names)


def resolved_choice(tools: tuple[FunctionTool, ...], choice: ToolChoice | None) -> ToolChoice:
    """The tool_choice in effect: as given, else ``auto`` with tools and ``none`` without."""
    if choice is not None:
        return choice
    return ToolChoice(ToolChoiceMode.AUTO if tools else ToolChoiceMode.NONE)


def plan_tools(
    tools: tuple[FunctionTool, ...],
    choice: ToolChoice | None,
    call_format: ToolCallFormat,
    *,
    is_chat: bool = False,
    shows_reasoning: bool = False,
) -> ToolPlan | None:
    """The plan of a validated request; None when its completion is not read for calls.

    Args:
        tools: The functions offered.
        choice: The request's tool_choice (None: the default).
        call_format: The model's call format.
        is_chat: The request is a chat (messages): a harmony chat is read without tools too.
        shows_reasoning: The API shows the reasoning the format's parser reads.
    """
    choice = resolved_choice(tools, choice)
    if choice.mode is ToolChoiceMode.NONE or not tools:
        if is_chat and call_format.reads_channels:
            return ToolPlan(
                call_format, ToolChoiceMode.NONE, frozenset(), shows_reasoning=shows_reasoning
            )
        return None
    names = frozenset(tool.name for tool in tools)
    return ToolPlan(
        call_format, choice.mode, names, choice.function_name, shows_reasoning=shows_reasoning
    )


def forced_call_constraint(
    tools: tuple[FunctionTool, ...], choice: ToolChoice | None, is_parallel: bool
) -> Constraint | None:
    """The constraint of a checked request whose tool_choice forces a call (REQUIRED or a
    named function); None for any other.

    Args:
        tools: The functions offered.
        choice: The request's tool_choice (None: the default).
        is_parallel: Whether a completion may make several calls (``parallel_tool_calls``).
    """
    choice = resolved_choice(tools, choice)
    if choice.mode is ToolChoiceMode.FUNCTION:
        tool = next(t for t in tools if t.name == choice.function_name)
        return _json_schema(tool.parameters_schema())
    if choice.mode is ToolChoiceMode.REQUIRED and tools:
        return _json_schema(calls_schema(tools, is_parallel))
    return None


def calls_schema(tools: tuple[FunctionTool, ...], is_parallel: bool) -> dict[str, Any]:
    """The JSON Schema of a list of calls of `tools` (at least one; one if not parallel).

    Each function's parameters schema sits under ``$defs`` (``tool_<name>``), its local
    references (``#/$defs/...``, ``#``) rewritten to point inside it, as they resolved when it
    was the root.
    """
    definitions = {}
    calls = []
    for tool in tools:
        key = f"tool_{tool.name}"
        parameters = {k: v for k, v in tool.parameters_schema().items() if k != "$schema"}
        definitions[key] = _rerooted(parameters, f"#/$defs/{key}")
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "const": tool.name},
                    "arguments": {"$ref": f"#/$defs/{key}"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "$defs": definitions,
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not is_parallel:
        schema["maxItems"] = 1
    return schema


def _rerooted(value: Any, root: str) -> Any:
    """`value` with its local ``$ref``s (``#...``) made relative to `root` (a JSON pointer
    fragment, ``#/$defs/tool_f``)."""
    if isinstance(value, dict):
        return {
            key: root + item[1:]
            if key == "$ref" and isinstance(item, str) and item.startswith("#")
            else _rerooted(item, root)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_rerooted(item, root) for item in value]
    return value


# NOTE: llguidance's JSON settings (other JSON Schema readers ignore the unknown keyword): one
# space after "," and ":" as models write JSON, and no other whitespace, so a weak model cannot
# spend its tokens on newlines.
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_schema(schema: dict[str, Any]) -> Constraint:
    laid_out = {"x-guidance": LAYOUT, **schema}
    text = json.dumps(laid_out, ensure_ascii=False, separators=(",", ":"))
    return Constraint(ConstraintKind.JSON_SCHEMA, text)
