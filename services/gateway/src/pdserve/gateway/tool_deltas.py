"""A completion's deltas with its tool calls read out: `with_tool_calls` turns each choice's
`OutputDelta`s (text) into deltas whose text is the content outside calls and whose
`tool_calls` are the calls' steps (ids, names, then pieces of arguments), as OpenAI streams
them. Both front ends get the same deltas; a non-streamed response joins them. A format that
marks reasoning (harmony's analysis channel) gives it in the deltas' `reasoning`.

Whitespace next to calls is not content: whitespace before a call or at the end of a
completion with calls is dropped, and so is whitespace right after a call. A completion that
ends by a stop (not by length) after at least one call ends with ``tool_calls`` (as OpenAI:
``stop`` for a named tool_choice).

A call's id is a function of its request's id and its place among the request's calls, so a
completion made again from its tokens (a resumed stream, a stored response read back, the
calls of a `previous_response_id` that the next turn's `function_call_output` items answer)
names its calls as the first time.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncGenerator
from dataclasses import replace

from pdserve.common.generation import FinishReason
from pdserve.gateway.request import OutputDelta
from pdserve.gateway.tools.parsers import (
    ArgumentsAdded,
    CallStarted,
    ContentAdded,
    ParseEvent,
    ReasoningAdded,
    ToolCallParser,
)
from pdserve.gateway.tools.plan import ToolPlan
from pdserve.gateway.tools.spec import ToolCallDelta


def call_id(request_id: str, index: int) -> str:
    """The id of a request's `index`-th call, shaped as OpenAI's (``call_`` + 24 hex)."""
    return "call_" + hashlib.sha256(f"{request_id}/{index}".encode()).hexdigest()[:24]


class ToolCallStream:
    """One choice's tool calls, read from its deltas in order.

    Args:
        plan: The request's tools and tool_choice.
        request_id: The choice's request id, which names its calls (`call_id`); None: a
            new id each time.
    """

    def __init__(self, plan: ToolPlan, request_id: str | None = None) -> None:
        self._plan = plan
        self._request_id = uuid.uuid4().hex if request_id is None else request_id
        self._parser: ToolCallParser = plan.new_parser()
        self._held_whitespace = ""  # content whitespace that a call may yet make void
        self._is_after_call = False  # drop whitespace that follows a call
        self.num_calls = 0

    def step(self, delta: OutputDelta) -> OutputDelta:
        """The delta with its text split into content and tool calls."""
        events = self._parser.feed(delta.text)
        is_last = delta.finish_reason is not None
        if is_last:
            events += self._parser.finish()
        content, calls, reasoning = self._apply(events)
        if is_last and not self.num_calls:
            content += self._held_whitespace
            self._held_whitespace = ""
        finish_reason = delta.finish_reason
        if finish_reason is FinishReason.STOP and self.num_calls and not self._plan.is_named:
            finish_reason = FinishReason.TOOL_CALLS
        return replace(
            delta,
            text=content,
            tool_calls=calls,
            finish_reason=finish_reason,
            reasoning=delta.reasoning + reasoning,
        )

    def _apply(self, events: list[ParseEvent]) -> tuple[str, tuple[ToolCallDelta, ...], str]:
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, ToolCallDelta] = {}
        for event in events:
            if isinstance(event, ReasoningAdded):
                reasoning.append(event.text)
            elif isinstance(event, ContentAdded):
                content.append(self._content(event.text))
            elif isinstance(event, CallStarted):
                self._held_whitespace = ""
                self._is_after_call = True
                index = self.num_calls
                self.num_calls += 1
                calls[index] = ToolCallDelta(index, call_id(self._request_id, index), event.name)
            elif isinstance(event, ArgumentsAdded):
                index = self.num_calls - 1
                current = calls.get(index) or ToolCallDelta(index)
                calls[index] = replace(current, arguments=current.arguments + event.text)
        return "".join(content), tuple(calls.values()), "".join(reasoning)

    def _content(self, text: str) -> str:
        """What of `text` is content now (whitespace is held until text follows it)."""
        if self._is_after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._is_after_call = False
        text = self._held_whitespace + text
        body = text.rstrip()
        self._held_whitespace = text[len(body) :]
        return body


async def with_tool_calls(
    deltas: AsyncGenerator[OutputDelta, None], plan: ToolPlan, request_id: str
) -> AsyncGenerator[OutputDelta, None]:
    """One choice's deltas with its tool calls read out (see the module doc)."""
    calls = ToolCallStream(plan, request_id)
    try:
        async for delta in deltas:
            yield calls.step(delta)
    finally:
        await deltas.aclose()
