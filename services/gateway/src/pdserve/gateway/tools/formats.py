"""The tool-call formats the common open models use, one per ``--tool-call-parser``.

A format says how a model of its family writes a call (which `pdserve.gateway.tools.parsers`
reads back), and how to show tools, calls and results to a model whose chat template does not
render them itself (the fallback of `pdserve.gateway.prepare.tool_prompt`):

* ``hermes`` (Hermes 2 Pro, Qwen 2.5 and 3, SmolLM): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one tag per call (a JSON list of calls in one tag is read too); results
  in ``<tool_response>`` tags;
* ``llama3_json`` (Llama 3.1 to 3.3 with JSON tool calling): the completion is the call,
  ``{"name": ..., "parameters": {...}}`` (an optional ``<|python_tag|>`` first; several calls
  separated by ``;``).

``auto`` (the default) picks ``llama3_json`` for a chat template that writes Llama 3's
``<|python_tag|>`` or its JSON-call instruction, and ``hermes`` for every other.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.gateway.tools.spec import FunctionTool, ToolCall

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
AUTO = "auto"
TOOL_CALL_PARSERS = (AUTO, HERMES, LLAMA3_JSON)

_LLAMA3_MARKERS = ("<|python_tag|>", '"parameters": dictionary of argument name')


def _tools_json(tools: Sequence[FunctionTool]) -> str:
    return "\n".join(json.dumps(tool.to_template(), ensure_ascii=False) for tool in tools)


def _call_json(call: ToolCall, arguments_key: str) -> str:
    arguments = call.to_template()["function"]["arguments"]
    return json.dumps({"name": call.name, arguments_key: arguments}, ensure_ascii=False)


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model family writes tool calls.

    Attributes:
        name: The ``--tool-call-parser`` value.
        arguments_keys: The keys of a call object that hold its arguments, preferred first.
    """

    name: str
    arguments_keys: tuple[str, ...]

    def tools_prompt(self, tools: Sequence[FunctionTool]) -> str:
        """The instruction that lists `tools` and the call format (fallback rendering)."""
        if self.name == LLAMA3_JSON:
            return (
                "Given the following functions, please respond with a JSON for a function call "
                "with its proper arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of '
                "argument name and its value}. Do not use variables.\n\n"
                f"{_tools_json(tools)}"
            )
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{_tools_json(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>"
        )

    def calls_text(self, calls: Sequence[ToolCall]) -> str:
        """`calls` as the model would have written them (fallback rendering)."""
        if self.name == LLAMA3_JSON:
            return "; ".join(_call_json(call, "parameters") for call in calls)
        return "\n".join(f"<tool_call>\n{_call_json(c, 'arguments')}\n</tool_call>" for c in calls)

    def result_text(self, content: str) -> str:
        """A tool's result as a user message's text (fallback rendering)."""
        return f"<tool_response>\n{content}\n</tool_response>"


FORMATS = {
    HERMES: ToolCallFormat(HERMES, ("arguments",)),
    LLAMA3_JSON: ToolCallFormat(LLAMA3_JSON, ("parameters", "arguments")),
}


def resolve_format(parser: str, template_source: str | None) -> ToolCallFormat:
    """The format of ``--tool-call-parser`` `parser` for a model with this chat template.

    Raises:
        ValueError: For a parser name not in `TOOL_CALL_PARSERS`.
    """
    if parser == AUTO:
        source = template_source or ""
        parser = LLAMA3_JSON if any(m in source for m in _LLAMA3_MARKERS) else HERMES
    if parser not in FORMATS:
        raise ValueError(f"unknown tool-call parser {parser!r}")
    return FORMATS[parser]
