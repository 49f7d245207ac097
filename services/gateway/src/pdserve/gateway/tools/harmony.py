"""gpt-oss's harmony format read out of a completion's text (special tokens kept): what the
model writes on the ``analysis`` channel is reasoning, on ``final`` the answer, and a
``commentary`` message addressed ``to=functions.NAME`` is a call of NAME whose arguments are
the message (JSON).

A completion of a harmony chat starts inside a message header (the prompt ends with
``<|start|>assistant``)::

    <|channel|>analysis<|message|>The user asks for the weather.<|end|>
    <|start|>assistant<|channel|>final<|message|>Sunny.<|return|>

    <|channel|>analysis<|message|>Need the tool.<|end|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

(one line each; the recipient ``to=...`` may also follow the channel name). A message's body
ends at ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last two end the completion), or at a
``<|start|>`` the model wrote without one. Headers are held until ``<|message|>``; a body
streams as it comes, holding back only what may begin an end marker.

What goes where:

* ``analysis`` bodies: `ReasoningAdded` (left out when reasoning is not shown);
* ``final`` bodies, ``commentary`` without a recipient (a preamble), and a message on a
  channel the parser does not know: content;
* ``to=functions.NAME`` with NAME among the offered functions: `CallStarted` and the body as
  `ArgumentsAdded`; any other recipient (a function not offered, a built-in tool): its body
  is content, as a Hermes call of an unknown function is.

A header that grows past `MAX_HEADER_CHARS` without ``<|message|>`` is no header: the text is
content from there on (a completion that does not follow the format).

NOTE: written here rather than taken from OpenAI's ``openai-harmony`` package: that parses
token ids with its own encoding (a Rust extension with the o200k vocabulary), while the
gateway reads every format from the detokenized text, with the markup tokens kept; the
format's grammar is small (five markers) and reading it takes a page.
"""

from __future__ import annotations

import re
from collections.abc import Container
from typing import NamedTuple

from pdserve.gateway.tools.json_calls import (
    ArgumentsAdded,
    CallStarted,
    ContentAdded,
    ParseEvent,
    ReasoningAdded,
)
from pdserve.gateway.tools.parsers import ToolCallParser
from pdserve.tokenizer.stop import partial_tail

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
MARKUP_TOKENS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
BODY_ENDS = (END, CALL, RETURN, START)
FUNCTIONS_PREFIX = "functions."
MAX_HEADER_CHARS = 256

_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"(?:^|\s|>)to=([^\s<]+)")


class _Header(NamedTuple):
    channel: str | None
    recipient: str | None


def read_header(text: str) -> _Header:
    """The channel and the recipient named in a message header's text."""
    channel = _CHANNEL_NAME.search(text)
    recipient = _RECIPIENT.search(text)
    return _Header(channel.group(1) if channel else None, recipient.group(1) if recipient else None)


class HarmonyParser(ToolCallParser):
    """One harmony completion's messages as reasoning, content and calls, as it streams.

    Args:
        names: The functions offered (empty: no message is a call).
        shows_reasoning: Whether analysis bodies are reasoning (else they are left out).
    """

    def __init__(self, names: Container[str], shows_reasoning: bool = True) -> None:
        self._names = names
        self._shows_reasoning = shows_reasoning
        self._buffer = ""
        self._state = "header"  # "header", "body" or "plain" (no format: all content)
        self._kind = "content"  # the body's: "content", "reasoning", "arguments", "drop"

    def feed(self, text: str) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        self._buffer += text
        while self._buffer and self._step(events):
            pass
        return events

    def finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        rest, self._buffer = self._buffer, ""
        if self._state == "header":
            if rest.strip() and "<|" not in rest:  # no markup at all: the model's answer
                events.append(ContentAdded(rest))
        elif rest:
            self._body(rest, events)
        return events

    def _step(self, events: list[ParseEvent]) -> bool:
        """Reads from the buffer; False when it needs more text."""
        buffer = self._buffer
        if self._state == "plain":
            self._buffer = ""
            events.append(ContentAdded(buffer))
            return False
        if self._state == "header":
            end = buffer.find(MESSAGE)
            if end < 0:
                if len(buffer) > MAX_HEADER_CHARS:
                    self._state = "plain"
                    return True
                return False
            self._open(buffer[:end], events)
            self._buffer = buffer[end + len(MESSAGE) :]
            self._state = "body"
            return True
        end, marker = _first_marker(buffer, BODY_ENDS)
        if end < 0:
            keep = partial_tail(buffer, BODY_ENDS)
            self._body(buffer[: len(buffer) - keep], events)
            self._buffer = buffer[len(buffer) - keep :]
            return False
        self._body(buffer[:end], events)
        # NOTE: the next message's header follows (its <|start|>, if the model wrote one
        # after the end marker, is part of the header's text).
        self._buffer = buffer[end + len(marker) :]
        self._state = "header"
        return True

    def _open(self, header: str, events: list[ParseEvent]) -> None:
        channel, recipient = read_header(header)
        if recipient is not None:
            name = recipient.removeprefix(FUNCTIONS_PREFIX)
            if recipient.startswith(FUNCTIONS_PREFIX) and name in self._names:
                events.append(CallStarted(name))
                self._kind = "arguments"
            else:
                self._kind = "content"
        elif channel == "analysis":
            self._kind = "reasoning" if self._shows_reasoning else "drop"
        else:
            self._kind = "content"

    def _body(self, text: str, events: list[ParseEvent]) -> None:
        if not text or self._kind == "drop":
            return
        if self._kind == "reasoning":
            events.append(ReasoningAdded(text))
        elif self._kind == "arguments":
            events.append(ArgumentsAdded(text))
        else:
            events.append(ContentAdded(text))


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The position and the marker of the first of `markers` in `text` ((-1, "") if none)."""
    found = [(position, marker) for marker in markers if (position := text.find(marker)) >= 0]
    return min(found) if found else (-1, "")
