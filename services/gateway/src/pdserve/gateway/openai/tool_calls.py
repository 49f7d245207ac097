"""Tool calls in OpenAI's chat shapes: a choice's ``message.tool_calls`` and a streamed chunk's
``delta.tool_calls`` entries, from the steps `pdserve.gateway.tool_deltas` reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.gateway.tools.spec import ToolCallDelta


def chat_message(text: str, tool_calls: Sequence[ToolCallDelta]) -> dict[str, Any]:
    """A chat choice's ``message``: its text and, when the model called tools, its
    ``tool_calls`` (the content is then null unless the model wrote text besides)."""
    if not tool_calls:
        return {"role": "assistant", "content": text}
    calls: dict[int, dict[str, Any]] = {}
    for step in tool_calls:
        call = calls.setdefault(
            step.index,
            {"id": step.id, "type": "function", "function": {"name": step.name, "arguments": ""}},
        )
        call["function"]["arguments"] += step.arguments
    return {"role": "assistant", "content": text or None, "tool_calls": list(calls.values())}


def tool_call_chunk(step: ToolCallDelta) -> dict[str, Any]:
    """One entry of a chunk's ``delta.tool_calls``: a call's first step carries its id, type
    and name, every step a piece of its arguments (as OpenAI streams them)."""
    if step.id is None:
        return {"index": step.index, "function": {"arguments": step.arguments}}
    return {
        "index": step.index,
        "id": step.id,
        "type": "function",
        "function": {"name": step.name, "arguments": step.arguments},
    }
