"""Tool calls read from a completion's text as it streams, one parser per output shape.

A parser takes the completion's text in pieces (`feed`) and once more at its end (`finish`),
and returns `ParseEvent`s: text outside calls (`ContentAdded`), a call's start
(`CallStarted`, once its name is known) and its arguments' text (`ArgumentsAdded`). A parser
holds back only what may still turn out to be markup (a partial ``<tool_call>``), so the text
of the events is the same however the completion was split, and a call's markup never reaches
the content. A call of a function the request did not offer is not a call: its text stays
content.

* `HermesParser`: calls in ``<tool_call>...</tool_call>`` tags anywhere in the text.
* `JsonCallsParser`: a completion that is calls, as Llama 3 writes them (``{"name": ...,
  "parameters": ...}``, optionally after ``<|python_tag|>``), or as the REQUIRED constraint
  makes them (``[{"name": ..., "arguments": ...}]``).
* `ArgumentsParser`: a completion that is the arguments of one named function (the constraint
  of a named tool_choice).

The last two hand a completion that does not start as they expect to a fallback parser (the
model's own format), which covers an engine that did not apply the constraint.
"""

from __future__ import annotations

import abc
from collections.abc import Container

from pdserve.gateway.tools.call_sequence import CallSequence
from pdserve.gateway.tools.json_calls import (
    ArgumentsAdded,
    CallStarted,
    ContentAdded,
    ParseEvent,
    ReasoningAdded,
    ValueEnd,
)
from pdserve.tokenizer.stop import partial_tail

__all__ = [
    "ArgumentsAdded",
    "ArgumentsParser",
    "CallStarted",
    "ContentAdded",
    "HermesParser",
    "JsonCallsParser",
    "ParseEvent",
    "ReasoningAdded",
    "ToolCallParser",
]

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _content(text: str) -> list[ParseEvent]:
    return [ContentAdded(text)] if text else []


class ToolCallParser(abc.ABC):
    """Reads one completion's tool calls as its text streams."""

    @abc.abstractmethod
    def feed(self, text: str) -> list[ParseEvent]:
        """The events the next piece of text adds."""

    @abc.abstractmethod
    def finish(self) -> list[ParseEvent]:
        """The events of what was held back, at the end of the completion."""


class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` tags between text.

    A tag may hold several calls (a JSON list, or objects one after another). A tag whose
    content is no call stays content, tags included; text inside a tag after its calls is
    dropped.

    Args:
        names: The functions offered.
    """

    def __init__(self, names: Container[str]) -> None:
        self._names = names
        self._buffer = ""  # content held back, or the text after a tag's calls
        self._tag: CallSequence | None = None  # inside a tag
        self._tag_text: list[str] = []  # the tag's text so far, shown if it holds no call
        self._is_after_calls = False  # the tag's calls are read; waiting for its end

    def feed(self, text: str) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        while text:
            if self._tag is None:
                text = self._feed_content(text, events)
            elif not self._is_after_calls:
                text = self._feed_calls(text, events)
            else:
                text = self._feed_tag_end(text, events)
        return events

    def _feed_content(self, text: str, events: list[ParseEvent]) -> str:
        buffer = self._buffer + text
        start = buffer.find(HERMES_START)
        if start < 0:
            keep = partial_tail(buffer, (HERMES_START,))
            events += _content(buffer[: len(buffer) - keep])
            self._buffer = buffer[len(buffer) - keep :]
            return ""
        events += _content(buffer[:start])
        self._buffer = ""
        self._tag = CallSequence(("arguments",), self._names)
        self._tag_text = [HERMES_START]
        self._is_after_calls = False
        return buffer[start + len(HERMES_START) :]

    def _feed_calls(self, text: str, events: list[ParseEvent]) -> str:
        assert self._tag is not None
        added, stop = self._tag.feed(text)
        events += added
        read = text if stop is None else text[: stop.position]
        self._tag_text.append(read)
        if stop is None:
            return ""
        self._is_after_calls = True
        return text[stop.position :]

    def _feed_tag_end(self, text: str, events: list[ParseEvent]) -> str:
        assert self._tag is not None
        buffer = self._buffer + text
        end = buffer.find(HERMES_END)
        if end < 0:
            self._buffer = buffer
            return ""
        self._tag_text.append(buffer[: end + len(HERMES_END)])
        if not self._tag.num_started:
            events += _content("".join(self._tag_text))
        self._tag = None
        self._buffer = ""
        return buffer[end + len(HERMES_END) :]

    def finish(self) -> list[ParseEvent]:
        tag, buffer = self._tag, self._buffer
        self._tag, self._buffer = None, ""
        if tag is None:
            return _content(buffer)
        tag.finish()  # what it read is in the tag's text already
        if not tag.num_started:
            return _content("".join(self._tag_text) + buffer)
        tail = buffer.strip()
        if tail and not HERMES_END.startswith(tail):
            # NOTE: a tag never closed, with text after its calls: the model's answer.
            return _content(buffer)
        return []


class JsonCallsParser(ToolCallParser):
    """A completion that is tool calls as JSON objects (one, a list, or several separated by
    ``;``); text after them is content. A completion that starts otherwise is content, or goes
    to `fallback`.

    Args:
        arguments_keys: The keys of a call object that hold its arguments.
        names: The functions offered.
        fallback: Reads a completion that does not start with ``{`` or ``[``; None: content.
    """

    def __init__(
        self,
        arguments_keys: tuple[str, ...],
        names: Container[str],
        fallback: ToolCallParser | None = None,
    ) -> None:
        self._calls = CallSequence(arguments_keys, names)
        self._fallback = fallback
        self._lead = ""  # the start, until it shows what the completion is
        self._mode: str | None = None  # None (undecided), "calls", "content" or "fallback"

    def feed(self, text: str) -> list[ParseEvent]:
        if self._mode is None:
            text = self._decide(self._lead + text)
            if self._mode is None:
                return []
        if self._mode == "content":
            return _content(text)
        if self._mode == "fallback":
            assert self._fallback is not None
            return self._fallback.feed(text)
        events, stop = self._calls.feed(text)
        if stop is not None:
            self._mode = "content"
            events += _content(stop.unread + text[stop.position :])
        return events

    def _decide(self, text: str) -> str:
        """Sets the mode once the start of the completion shows it; the text left to read."""
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG):
            return self._decide(stripped[len(PYTHON_TAG) :])
        if not stripped or (self._fallback is None and PYTHON_TAG.startswith(stripped)):
            self._lead = text
            return ""
        self._lead = ""
        if stripped[0] in "{[":
            self._mode = "calls"
            return stripped
        self._mode = "content" if self._fallback is None else "fallback"
        return text

    def finish(self) -> list[ParseEvent]:
        if self._mode is None:
            text, self._lead = self._lead, ""
            if self._fallback is not None:
                return [*self._fallback.feed(text), *self._fallback.finish()]
            return _content(text)
        if self._mode == "fallback":
            assert self._fallback is not None
            return self._fallback.finish()
        if self._mode == "calls":
            return _content(self._calls.finish())
        return []


class ArgumentsParser(ToolCallParser):
    """A completion that is the arguments (a JSON object) of one call of `name`; text after
    the object is content. A completion that starts otherwise goes to `fallback`.

    Args:
        name: The function called.
        fallback: Reads a completion that does not start with ``{``.
    """

    def __init__(self, name: str, fallback: ToolCallParser) -> None:
        self._name = name
        self._fallback = fallback
        self._value_end = ValueEnd()
        self._mode: str | None = None  # None (undecided), "arguments", "content", "fallback"
        self._lead = ""

    def feed(self, text: str) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if self._mode is None:
            text = self._lead + text
            stripped = text.lstrip()
            if not stripped:
                self._lead = text
                return []
            self._lead = ""
            if not stripped.startswith("{"):
                self._mode = "fallback"
            else:
                self._mode = "arguments"
                events.append(CallStarted(self._name))
                text = stripped
        if self._mode == "fallback":
            return self._fallback.feed(text)
        if self._mode == "content":
            return _content(text)
        for position, char in enumerate(text):
            if self._value_end.push(char):
                self._mode = "content"
                events.append(ArgumentsAdded(text[: position + 1]))
                return events + _content(text[position + 1 :])
        events.append(ArgumentsAdded(text))
        return events

    def finish(self) -> list[ParseEvent]:
        if self._mode is None:
            lead, self._lead = self._lead, ""
            return [*self._fallback.feed(lead), *self._fallback.finish()]
        if self._mode == "fallback":
            return self._fallback.finish()
        return []
