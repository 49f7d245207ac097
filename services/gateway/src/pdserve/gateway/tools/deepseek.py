"""DeepSeek's tool calls read out of a completion's text, as DeepSeek-V3's (and R1's) chat
template writes them::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(the markers are the tokenizer's own: fullwidth ``｜`` U+FF5C and ``▁`` U+2581). DeepSeek-V3.1
writes the name before the separator and the arguments right after it
(``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``); both
read the same.

Text before the calls and after ``<｜tool▁calls▁end｜>`` is content. A call's arguments stream
as the model writes them (their end found by `ValueEnd`; the closing fence is dropped). A call
of a function the request did not offer is content as the model wrote it, from
``<｜tool▁call▁begin｜>`` to ``<｜tool▁call▁end｜>``; from a call whose markup does not parse on,
the whole text is content as written.
"""

from __future__ import annotations

import re
from collections.abc import Container

from pdserve.gateway.tools.json_calls import (
    ArgumentsAdded,
    CallStarted,
    ContentAdded,
    ParseEvent,
    ValueEnd,
)
from pdserve.gateway.tools.parsers import ToolCallParser
from pdserve.tokenizer.stop import partial_tail

CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
MARKUP_TOKENS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
FUNCTION_TYPE = "function"
MAX_HEAD_CHARS = 256  # a call's type and name, and its lead up to the arguments
_LEAD = re.compile(r"\s*(?:```[A-Za-z]*)?\s*")  # what may come between a name and "{"


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    found = [(position, marker) for marker in markers if (position := text.find(marker)) >= 0]
    return min(found) if found else (-1, "")


def _add_content(events: list[ParseEvent], text: str) -> None:
    if text:
        events.append(ContentAdded(text))


class DeepSeekParser(ToolCallParser):
    """DeepSeek-V3's tool calls between text (see the module doc).

    Args:
        names: The functions offered.
    """

    def __init__(self, names: Container[str]) -> None:
        self._names = names
        self._buffer = ""
        # "content", "section" (between calls), "head" (before the separator), "lead" (after
        # it, up to the arguments), "arguments", "tail" (after them, up to the call's end),
        # "skip" (a call that is not one, up to its end)
        self._state = "content"
        self._raw = ""  # the call's text read so far, shown if it is no call
        self._head = ""  # the call's text before the separator
        self._value_end = ValueEnd()
        self._handlers = {
            "content": self._read_content,
            "section": self._read_section,
            "head": self._read_head,
            "lead": self._read_lead,
            "arguments": self._read_arguments,
            "tail": self._read_tail,
            "skip": self._read_skip,
        }

    def feed(self, text: str) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        self._buffer += text
        while self._buffer and self._handlers[self._state](events):
            pass
        return events

    def finish(self) -> list[ParseEvent]:
        rest, self._buffer = self._buffer, ""
        events: list[ParseEvent] = []
        if self._state == "content":
            _add_content(events, rest)
        elif self._state in ("head", "lead", "skip"):
            _add_content(events, self._raw + rest)
        # NOTE: a call cut off keeps its arguments as far as they got; a marker cut off
        # between calls is dropped.
        return events

    def _read_content(self, events: list[ParseEvent]) -> bool:
        buffer = self._buffer
        start, marker = _first(buffer, (CALLS_BEGIN, CALL_BEGIN))
        if start < 0:
            keep = partial_tail(buffer, (CALLS_BEGIN, CALL_BEGIN))
            _add_content(events, buffer[: len(buffer) - keep])
            self._buffer = buffer[len(buffer) - keep :]
            return False
        _add_content(events, buffer[:start])
        self._buffer = buffer[start:] if marker == CALL_BEGIN else buffer[start + len(marker) :]
        self._state = "section"
        return True

    def _read_section(self, events: list[ParseEvent]) -> bool:
        buffer = self._buffer.lstrip()
        self._buffer = buffer
        if not buffer:
            return False
        if buffer.startswith(CALL_BEGIN):
            self._buffer = buffer[len(CALL_BEGIN) :]
            self._raw, self._state = CALL_BEGIN, "head"
            return True
        if buffer.startswith(CALLS_END):
            self._buffer = buffer[len(CALLS_END) :]
            self._state = "content"
            return True
        if CALL_BEGIN.startswith(buffer) or CALLS_END.startswith(buffer):
            return False
        self._state = "content"  # text that is no markup: the model went on writing
        return True

    def _read_head(self, events: list[ParseEvent]) -> bool:
        buffer = self._buffer
        end = buffer.find(SEP)
        if end < 0:
            if len(buffer) > MAX_HEAD_CHARS:
                self._broken(events)
                return True
            return False
        self._head = buffer[:end]
        self._raw += buffer[: end + len(SEP)]
        self._buffer = buffer[end + len(SEP) :]
        self._state = "lead"
        return True

    def _read_lead(self, events: list[ParseEvent]) -> bool:
        buffer = self._buffer
        head = self._head.strip()
        name_end = 0
        if head == FUNCTION_TYPE and not buffer.lstrip().startswith("{"):
            # DeepSeek-V3: the name, then a line break and the fenced arguments.
            name_end = buffer.find("\n")
            if name_end < 0:
                return self._wait_or_break(events)
            name = buffer[:name_end].strip()
        else:
            name = head  # DeepSeek-V3.1: the name before the separator
        brace = buffer.find("{", name_end)
        if brace < 0:
            if not _LEAD.fullmatch(buffer, name_end) and not _is_fence_start(buffer[name_end:]):
                self._broken(events)
                return True
            return self._wait_or_break(events)
        if not _LEAD.fullmatch(buffer, name_end, brace) or not name:
            self._broken(events)
            return True
        self._raw += buffer[:brace]
        self._buffer = buffer[brace:]
        if name in self._names:
            events.append(CallStarted(name))
            self._raw = ""
            self._value_end = ValueEnd()
            self._state = "arguments"
        else:
            self._state = "skip"
        return True

    def _wait_or_break(self, events: list[ParseEvent]) -> bool:
        if len(self._raw) + len(self._buffer) > MAX_HEAD_CHARS:
            self._broken(events)
            return True
        return False

    def _read_arguments(self, events: list[ParseEvent]) -> bool:
        buffer = self._buffer
        for position, char in enumerate(buffer):
            if self._value_end.push(char):
                events.append(ArgumentsAdded(buffer[: position + 1]))
                self._buffer = buffer[position + 1 :]
                self._state = "tail"
                return True
        events.append(ArgumentsAdded(buffer))
        self._buffer = ""
        return False

    def _read_tail(self, events: list[ParseEvent]) -> bool:
        end = self._buffer.find(CALL_END)
        if end < 0:
            if len(self._buffer) > MAX_HEAD_CHARS:
                self._state = "content"  # no end after the arguments: the model's text
                return True
            return False
        self._buffer = self._buffer[end + len(CALL_END) :]  # the closing fence is dropped
        self._state = "section"
        return True

    def _read_skip(self, events: list[ParseEvent]) -> bool:
        buffer = self._buffer
        end = buffer.find(CALL_END)
        if end < 0:
            keep = partial_tail(buffer, (CALL_END,))
            self._raw += buffer[: len(buffer) - keep]
            self._buffer = buffer[len(buffer) - keep :]
            return False
        _add_content(events, self._raw + buffer[: end + len(CALL_END)])
        self._raw = ""
        self._buffer = buffer[end + len(CALL_END) :]
        self._state = "section"
        return True

    def _broken(self, events: list[ParseEvent]) -> None:
        """The call's markup does not parse: its begin marker is content, and what follows
        it is read again as content."""
        _add_content(events, CALL_BEGIN)
        self._buffer = self._raw[len(CALL_BEGIN) :] + self._buffer
        self._raw = ""
        self._state = "content"


def _is_fence_start(text: str) -> bool:
    """Whether `text` may still grow into whitespace and a fence (``\n```json\n``)."""
    stripped = text.lstrip()
    return (
        not stripped
        or ("```".startswith(stripped[:3]) and stripped[3:].isalpha())
        or ("```".startswith(stripped))
    )
