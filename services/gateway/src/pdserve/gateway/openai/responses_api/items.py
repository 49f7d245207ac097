"""A completion's deltas as a `Response`'s output items, and the events that build them.

Text is an assistant ``message`` item with one ``output_text`` part; each tool call a
``function_call`` item (``id`` ``fc_`` and the call id's hex, ``call_id``, ``name``,
``arguments``); reasoning the model wrote (read out by the reasoning parser: a think block, or
harmony's analysis channel) a ``reasoning`` item (``id`` ``rs_...``, an empty ``summary`` and
one ``reasoning_text`` part), streamed as ``response.reasoning_text.delta`` events. Items
follow each other in the order the completion writes them, one open at a time, as OpenAI
streams them: a call closes the message before it, text after calls opens a new message. A
completion with neither text nor calls is one empty message.

A request that asks for logprobs (``include: ["message.output_text.logprobs"]``) gets, on each
``output_text`` part and in its delta and done events, the entries of the tokens whose text it
holds: the writer gives `step` each delta's entries (its special and stop tokens left out, as
chat's), and they go with the next text the message gets (a token whose text is held back, a
stop string's candidate, joins the text it ends in); the tokens of a delta that wrote only
reasoning or calls are theirs and listed nowhere, and a delta that wrote reasoning and text
together lists all of its tokens with the text.

`OutputItems` is pure: `step` and `finish` return the events as ``(type, fields)`` values, and
the writer numbers and sends them (a non-streamed response only reads `items`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pdserve.gateway.request import OutputDelta
from pdserve.gateway.tools.spec import ToolCallDelta

CONTENT_INDEX = 0  # a message's text is its one content part


class Event(NamedTuple):
    """A stream event before it is numbered: its type and fields."""

    type: str
    fields: dict[str, Any]


class _TextKind(NamedTuple):
    """How an item of text (a message, reasoning) is made and streamed."""

    id_prefix: str
    fields: dict[str, Any]  # the item's own fields, beside id, type, status and its part
    part: Callable[[str], dict[str, Any]]
    delta_event: str
    done_event: str
    has_logprobs: bool  # its part, delta and done events carry ``logprobs``


def output_text(text: str) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_text(text: str) -> dict[str, Any]:
    """A ``reasoning_text`` content part (of a ``reasoning`` item)."""
    return {"type": "reasoning_text", "text": text}


_TEXT_KINDS = {
    "reasoning": _TextKind(
        "rs", {"summary": []}, reasoning_text,
        "response.reasoning_text.delta", "response.reasoning_text.done", False,
    ),
    "message": _TextKind(
        "msg", {"role": "assistant"}, output_text,
        "response.output_text.delta", "response.output_text.done", True,
    ),
}  # fmt: skip


class OutputItems:
    """The output items of one completion, built delta by delta.

    Args:
        request_id: The request's id (the first message item is ``msg_<request id>``).
    """

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id
        self.items: list[dict[str, Any]] = []
        self._is_open = False  # whether the last item is still being written
        self._num_opened = dict.fromkeys(_TEXT_KINDS, 0)  # text items of each kind so far
        self._pending_logprobs: list[dict[str, Any]] = []  # tokens whose text has not come

    def step(self, delta: OutputDelta, logprobs: Sequence[dict[str, Any]] = ()) -> list[Event]:
        """The events of one delta: its reasoning, its text, then its calls' steps;
        `logprobs`: its tokens' entries, for the message's text (see the module)."""
        events: list[Event] = []
        self._pending_logprobs += logprobs
        if delta.reasoning:
            events += self._text_step("reasoning", delta.reasoning)
        if delta.text:
            pending, self._pending_logprobs = self._pending_logprobs, []
            events += self._text_step("message", delta.text, pending)
        elif delta.reasoning or delta.tool_calls:
            self._pending_logprobs = []  # NOTE: the reasoning's or the calls' tokens
        for call in delta.tool_calls:
            events += self._call_step(call)
        return events

    def finish(self, status: str) -> list[Event]:
        """The events that close the last item with `status` (an empty message when there
        were no items)."""
        events = [] if self.items else self._open_text("message")
        return events + self._close(status)

    def output(self, status: str, with_text: bool = False) -> list[dict[str, Any]]:
        """The items as a `Response` of item status `status` lists them, without events: an
        open item gets `status`, an in-progress message no content yet (its text so far with
        `with_text`: a polled background response)."""
        items = [dict(item) for item in self.items]
        if self._is_open:
            last = items[-1]
            last["status"] = status
            is_text = last["type"] in _TEXT_KINDS
            if is_text and status == "in_progress" and not with_text:
                last["content"] = []
        return items

    # ---- items ------------------------------------------------------------------------------

    def _is_open_as(self, kind: str) -> bool:
        return self._is_open and self.items[-1]["type"] == kind

    def _text_step(
        self, kind: str, text: str, logprobs: Sequence[dict[str, Any]] = ()
    ) -> list[Event]:
        """`text` (and its tokens' `logprobs`, a message's) added to the open item of `kind`
        (one opened after the others closed)."""
        events: list[Event] = []
        if not self._is_open_as(kind):
            events += self._close("completed")
            events += self._open_text(kind)
        part = self.items[-1]["content"][CONTENT_INDEX]
        part["text"] += text
        spec = _TEXT_KINDS[kind]
        fields: dict[str, Any] = {"delta": text}
        if spec.has_logprobs:
            part["logprobs"] += logprobs
            fields["logprobs"] = list(logprobs)
        events.append(self._text_event(spec.delta_event, **fields))
        return events

    def _open_text(self, kind: str) -> list[Event]:
        spec = _TEXT_KINDS[kind]
        count = self._num_opened[kind]
        self._num_opened[kind] = count + 1
        item = {
            "id": f"{spec.id_prefix}_{self._request_id}" + (f"_{count}" if count else ""),
            "type": kind,
            "status": "in_progress",
            **spec.fields,
            "content": [spec.part("")],
        }
        self.items.append(item)
        self._is_open = True
        return [
            self._added({**item, "content": []}),
            self._text_event("response.content_part.added", part=spec.part("")),
        ]

    def _call_step(self, call: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if call.id is not None:
            events += self._close("completed")
            item = {
                "id": "fc_" + call.id.removeprefix("call_"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call.id,
                "name": call.name or "",
                "arguments": "",
            }
            self.items.append(item)
            self._is_open = True
            events.append(self._added(dict(item)))
        if call.arguments and self._is_open_as("function_call"):
            item = self.items[-1]
            item["arguments"] += call.arguments
            events.append(
                Event(
                    "response.function_call_arguments.delta",
                    {"item_id": item["id"], "output_index": self._index, "delta": call.arguments},
                )
            )
        return events

    def _close(self, status: str) -> list[Event]:
        """The events that close the open item (none when no item is open)."""
        if not self._is_open:
            return []
        self._is_open = False
        item = self.items[-1]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self._index}
        events = []
        spec = _TEXT_KINDS.get(item["type"])
        if spec is not None:
            part = item["content"][CONTENT_INDEX]
            fields = {"text": part["text"]}
            if spec.has_logprobs:
                fields["logprobs"] = list(part["logprobs"])
            events += [
                self._text_event(spec.done_event, **fields),
                self._text_event("response.content_part.done", part=dict(part)),
            ]
        else:
            events.append(
                Event(
                    "response.function_call_arguments.done",
                    {**where, "name": item["name"], "arguments": item["arguments"]},
                )
            )
        done = {"output_index": self._index, "item": dict(item)}
        events.append(Event("response.output_item.done", done))
        return events

    # ---- events -----------------------------------------------------------------------------

    @property
    def _index(self) -> int:
        """The output index of the last item."""
        return len(self.items) - 1

    def _added(self, item: dict[str, Any]) -> Event:
        return Event("response.output_item.added", {"output_index": self._index, "item": item})

    def _text_event(self, event_type: str, **fields: Any) -> Event:
        return Event(
            event_type,
            {
                "item_id": self.items[-1]["id"],
                "output_index": self._index,
                "content_index": CONTENT_INDEX,
                **fields,
            },
        )
