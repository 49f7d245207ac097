"""A Responses API body's function tools, as the chat path's `FunctionTool` and `ToolChoice`.

Responses writes a function tool flat, ``{"type": "function", "name", "description",
"parameters", "strict"}``, where chat nests it under ``function``; a named ``tool_choice`` is
``{"type": "function", "name"}``. Built-in tools (web search, file search, ...) and tool
choices of other types are refused with a 400 naming them.
"""

from __future__ import annotations

import json
from typing import Any, cast

from pdserve.gateway.openai.responses_api.schemas import (
    FunctionTool as FunctionToolBody,
)
from pdserve.gateway.openai.responses_api.schemas import (
    FunctionToolChoice,
    ResponsesRequest,
)
from pdserve.gateway.prepare.validation import invalid
from pdserve.gateway.tools.spec import TOOL_NAME_PATTERN, FunctionTool, ToolChoice, ToolChoiceMode


def function_tools(request: ResponsesRequest) -> tuple[FunctionTool, ...]:
    """The request's tools as chat `FunctionTool`s (parameters as JSON text).

    Raises:
        PdserveError: INVALID_REQUEST naming the first built-in tool (``tools[i]``), or a
            function name that is not OpenAI's shape or not unique (``tools[i].name``; the
            chat path checks the rest, as for chat's tools).
    """
    tools: list[FunctionTool] = []
    for index, tool in enumerate(request.tools or ()):
        kind = tool["type"]
        if kind != "function":
            raise invalid(
                f"built-in tool {kind[:64]!r} is not supported (only function tools are)",
                f"tools[{index}]",
            )
        body = cast(FunctionToolBody, tool)
        # NOTE: checked here too, so that the error names Responses' flat tools[i].name.
        if not TOOL_NAME_PATTERN.fullmatch(body["name"]):
            raise invalid(
                f"tools[{index}].name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
                f"tools[{index}].name",
            )
        if any(t.name == body["name"] for t in tools):
            raise invalid(
                f"tools[{index}].name {body['name']!r} is not unique", f"tools[{index}].name"
            )
        parameters = body.get("parameters")
        tools.append(
            FunctionTool(
                body["name"],
                body.get("description"),
                None if parameters is None else json.dumps(parameters, ensure_ascii=False),
                body.get("strict"),
            )
        )
    return tuple(tools)


def tool_choice(request: ResponsesRequest) -> ToolChoice | None:
    """The request's ``tool_choice`` as the chat path's (None when not given).

    Raises:
        PdserveError: INVALID_REQUEST for a tool choice of a type other than ``function``.
    """
    choice = request.tool_choice
    if choice is None:
        return None
    if isinstance(choice, str):
        return ToolChoice(ToolChoiceMode(choice))
    if choice["type"] != "function":
        raise invalid(
            f"tool_choice of type {choice['type'][:64]!r} is not supported "
            "(none, auto, required or a function)",
            "tool_choice",
        )
    return ToolChoice(ToolChoiceMode.FUNCTION, cast(FunctionToolChoice, choice)["name"])


def echoed_tools(request: ResponsesRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as a `Response` object repeats
    them (each function tool with all its fields)."""
    tools = [
        {
            "type": "function",
            "name": tool["name"],
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
            "strict": tool.get("strict"),
        }
        for tool in cast(list[FunctionToolBody], request.tools or [])
    ]
    return {
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tool_choice": request.tool_choice or "auto",
        "tools": tools,
    }
