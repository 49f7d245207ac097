"""The tool-call formats the common open models use, one per ``--tool-call-parser``.

A format says how a model of its family writes a call (which `pdserve.gateway.tools.parsers`
reads back), and how to show tools, calls and results to a model whose chat template does not
render them itself (the fallback of `pdserve.gateway.prepare.tool_prompt`):

* ``hermes`` (Hermes 2 Pro, Qwen 2.5 and 3, SmolLM): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one tag per call (a JSON list of calls in one tag is read too); results
  in ``<tool_response>`` tags;
* ``llama3_json`` (Llama 3.1 to 3.3 with JSON tool calling): the completion is the call,
  ``{"name": ..., "parameters": {...}}`` (an optional ``<|python_tag|>`` first; several calls
  separated by ``;``);
* ``harmony`` (gpt-oss): messages on channels, a call is a ``commentary`` message
  ``to=functions.NAME`` whose body is the arguments (`pdserve.gateway.tools.harmony`); the
  completion's reasoning (``analysis``) is read by the same parser;
* ``deepseek_v3`` (DeepSeek-V3, R1): calls between ``<｜tool▁calls▁begin｜>`` and
  ``<｜tool▁calls▁end｜>`` (`pdserve.gateway.tools.deepseek`).

``auto`` (the default) picks by the chat template: ``harmony`` for one that writes harmony's
``<|channel|>`` and ``<|message|>``, ``deepseek_v3`` for one that writes
``<｜tool▁calls▁begin｜>``, ``llama3_json`` for one that writes Llama 3's ``<|python_tag|>`` or
its JSON-call instruction, and ``hermes`` for every other. (The gateway gets a model's
tokenizer and chat template from its prefill, not its ``config.json``: the template is what
tells the family's chat format.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.gateway.tools import deepseek, harmony
from pdserve.gateway.tools.spec import FunctionTool, ToolCall

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
HARMONY = "harmony"
DEEPSEEK_V3 = "deepseek_v3"
AUTO = "auto"
TOOL_CALL_PARSERS = (AUTO, HERMES, LLAMA3_JSON, HARMONY, DEEPSEEK_V3)

_LLAMA3_MARKERS = ("<|python_tag|>", '"parameters": dictionary of argument name')
_HARMONY_MARKERS = (harmony.CHANNEL, harmony.MESSAGE)


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
        markup_tokens: The tokens the format's parser reads: when the tokenizer marks them
            special, the completion is decoded with them kept (other special tokens are still
            left out).
    """

    name: str
    arguments_keys: tuple[str, ...]
    markup_tokens: tuple[str, ...] = ()

    @property
    def reads_channels(self) -> bool:
        """Whether every chat completion is read by the format's parser, calls or not (its
        answer and reasoning are on channels: harmony)."""
        return self.name == HARMONY

    def tools_prompt(self, tools: Sequence[FunctionTool]) -> str:
        """The instruction that lists `tools` and the call format (fallback rendering)."""
        if self.name == DEEPSEEK_V3:
            example = _deepseek_call("<function-name>", "<args-json-object>")
            return (
                "## Tools\nYou have access to the following functions (one JSON per line):\n"
                f"{_tools_json(tools)}\n\nTo call functions, write:\n"
                f"{deepseek.CALLS_BEGIN}{example}{deepseek.CALLS_END}"
            )
        if self.name == HARMONY:
            return (
                "# Tools\n\n## functions\n\nCall a function with a commentary message to "
                "functions.<name> whose body is its arguments (a JSON object). The functions "
                f"(one JSON per line):\n{_tools_json(tools)}"
            )
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
        if self.name == DEEPSEEK_V3:
            body = "\n".join(_deepseek_call(c.name, c.arguments) for c in calls)
            return f"{deepseek.CALLS_BEGIN}{body}{deepseek.CALLS_END}"
        if self.name == HARMONY:
            return "".join(
                f"{harmony.START}assistant to=functions.{c.name}{harmony.CHANNEL}commentary "
                f"{harmony.CONSTRAIN}json{harmony.MESSAGE}{c.arguments}{harmony.CALL}"
                for c in calls
            )
        return "\n".join(f"<tool_call>\n{_call_json(c, 'arguments')}\n</tool_call>" for c in calls)

    def result_text(self, content: str) -> str:
        """A tool's result as a user message's text (fallback rendering)."""
        return f"<tool_response>\n{content}\n</tool_response>"


def _deepseek_call(name: str, arguments: str) -> str:
    return (
        f"{deepseek.CALL_BEGIN}{deepseek.FUNCTION_TYPE}{deepseek.SEP}{name}\n```json\n"
        f"{arguments}\n```{deepseek.CALL_END}"
    )


FORMATS = {
    HERMES: ToolCallFormat(HERMES, ("arguments",)),
    LLAMA3_JSON: ToolCallFormat(LLAMA3_JSON, ("parameters", "arguments")),
    HARMONY: ToolCallFormat(HARMONY, ("arguments",), harmony.MARKUP_TOKENS),
    DEEPSEEK_V3: ToolCallFormat(DEEPSEEK_V3, ("arguments",), deepseek.MARKUP_TOKENS),
}


def format_of_template(template_source: str | None) -> str:
    """The format ``auto`` picks for a model with this chat template."""
    source = template_source or ""
    if all(marker in source for marker in _HARMONY_MARKERS):
        return HARMONY
    if deepseek.CALLS_BEGIN in source:
        return DEEPSEEK_V3
    if any(marker in source for marker in _LLAMA3_MARKERS):
        return LLAMA3_JSON
    return HERMES


def resolve_format(parser: str, template_source: str | None) -> ToolCallFormat:
    """The format of ``--tool-call-parser`` `parser` for a model with this chat template.

    Raises:
        ValueError: For a parser name not in `TOOL_CALL_PARSERS`.
    """
    if parser == AUTO:
        parser = format_of_template(template_source)
    if parser not in FORMATS:
        raise ValueError(f"unknown tool-call parser {parser!r}")
    return FORMATS[parser]
