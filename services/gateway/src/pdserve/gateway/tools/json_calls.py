"""Call objects read a character at a time, as a completion streams.

`CallObject` reads one ``{"name": "f", "arguments": {...}}``: the name is known once its string
closes, and the arguments stream as they arrive from then on (held until the name is known, for
a model that writes them first; `pdserve.gateway.tools.call_sequence` reads several). It works
on the characters seen so far, so a call split anywhere across deltas reads the same as one
delta.

NOTE: written here rather than with an incremental JSON library: what is needed is not the
value (``json.loads`` gives that at the end) but the positions of the name and the arguments'
text while the object is still open, and the one such parser in common use
(partial-json-parser) re-parses the whole text on every delta.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Container
from typing import NamedTuple

WHITESPACE = frozenset(" \t\r\n")


class ContentAdded(NamedTuple):
    """Text of the completion outside tool calls."""

    text: str


class CallStarted(NamedTuple):
    """A new call of the function `name` (its arguments follow)."""

    name: str


class ArgumentsAdded(NamedTuple):
    """The next piece of the latest call's arguments (JSON text)."""

    text: str


class ReasoningAdded(NamedTuple):
    """Reasoning text of the completion (a format that marks it: harmony's analysis channel)."""

    text: str


ParseEvent = ContentAdded | CallStarted | ArgumentsAdded | ReasoningAdded


class ValueEnd:
    """Finds where a JSON object or array ends, a character at a time (strings and escapes
    included)."""

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def push(self, char: str) -> bool:
        """Takes the next character (the first is the opening bracket); True once the value
        is closed."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return False
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            return self._depth == 0
        return False


class _State(enum.Enum):
    START = enum.auto()  # before the opening brace
    KEY_OR_END = enum.auto()  # after "{" or ","
    KEY = enum.auto()  # inside a key's string
    COLON = enum.auto()
    VALUE_START = enum.auto()
    STRING_VALUE = enum.auto()
    CONTAINER_VALUE = enum.auto()
    SCALAR_VALUE = enum.auto()
    AFTER_VALUE = enum.auto()
    DONE = enum.auto()  # the closing brace was read
    BROKEN = enum.auto()  # not a JSON object (the character that showed it was read)


class CallObject:
    """One call object, read a character at a time.

    Args:
        arguments_keys: The keys that hold the arguments (the first one present wins).
        names: The functions that may be called; a call of any other is not a call.
    """

    def __init__(self, arguments_keys: tuple[str, ...], names: Container[str]) -> None:
        self._arguments_keys = arguments_keys
        self._names = names
        self._state = _State.START
        self._chars: list[str] = []  # the raw text read so far
        self._token: list[str] = []  # the key or value being read
        self._escaped = False
        self._value_end = ValueEnd()
        self._key = ""
        self._arguments_key: str | None = None
        self._has_arguments = False  # the arguments' value was read to its end
        self._pending: list[str] = []  # arguments text not yet handed out
        self.name: str | None = None
        self.is_rejected = False  # a name that is not a string or not a function offered
        self.is_started = False  # CallStarted was handed out

    @property
    def raw(self) -> str:
        """The text read so far."""
        return "".join(self._chars)

    @property
    def is_done(self) -> bool:
        return self._state is _State.DONE

    @property
    def is_broken(self) -> bool:
        return self._state is _State.BROKEN

    @property
    def is_call(self) -> bool:
        """Whether it is (so far) a call of an offered function."""
        return self.name is not None and not self.is_rejected and not self.is_broken

    def push(self, char: str) -> None:
        """Reads the next character; `is_done` or `is_broken` tell when it is over."""
        self._chars.append(char)
        state = self._state
        if state is _State.START:
            self._expect(char, "{", _State.KEY_OR_END)
        elif state is _State.KEY_OR_END:
            if char == '"':
                self._token = []
                self._state = _State.KEY
            elif char == "}":
                self._state = _State.DONE
            elif char not in WHITESPACE:
                self._state = _State.BROKEN
        elif state in (_State.KEY, _State.STRING_VALUE):
            self._push_string(char)
        elif state is _State.COLON:
            self._expect(char, ":", _State.VALUE_START)
        elif state is _State.VALUE_START:
            self._start_value(char)
        elif state is _State.CONTAINER_VALUE:
            self._token.append(char)
            if self._is_reading_arguments:
                self._pending.append(char)
            if self._value_end.push(char):
                self._end_value()
        elif state is _State.SCALAR_VALUE:
            if char in WHITESPACE or char in ",}":
                self._end_value()
                self._after_value(char)
            else:
                self._token.append(char)
        elif state is _State.AFTER_VALUE:
            self._after_value(char)

    def _expect(self, char: str, wanted: str, then: _State) -> None:
        """White space waits; `wanted` leads to `then`; anything else breaks the object."""
        if char == wanted:
            self._state = then
        elif char not in WHITESPACE:
            self._state = _State.BROKEN

    def _push_string(self, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            text = self._decoded(['"', *self._token, '"'])
            if not isinstance(text, str):
                self._state = _State.BROKEN
            elif self._state is _State.KEY:
                self._key = text
                self._state = _State.COLON
            else:
                self._token = ['"', *self._token, '"']
                self._end_value()
            return
        self._token.append(char)

    def _start_value(self, char: str) -> None:
        if char in WHITESPACE:
            return
        if self._arguments_key is None and self._key in self._arguments_keys:
            self._arguments_key = self._key
        self._token = []
        if char == '"':
            self._state = _State.STRING_VALUE
        elif char in "{[":
            self._state = _State.CONTAINER_VALUE
            self._value_end = ValueEnd()
            self._token.append(char)
            if self._is_reading_arguments:
                self._pending.append(char)
            self._value_end.push(char)
        else:
            self._token = [char]
            self._state = _State.SCALAR_VALUE

    def _end_value(self) -> None:
        text = "".join(self._token)
        self._state = _State.AFTER_VALUE
        if self._key == "name" and self.name is None:
            value = self._decoded(text)
            self.name = value if isinstance(value, str) else ""
            self.is_rejected = not isinstance(value, str) or value not in self._names
        elif self._is_reading_arguments:
            self._has_arguments = True
            if text.startswith('"'):
                # NOTE: some models quote the arguments' JSON; the call carries the JSON.
                self._pending = [str(self._decoded(text))]
            elif not text.startswith(("{", "[")):
                self._pending = ["{}" if text == "null" else text]
        # NOTE: the object's other keys (and a second arguments key) are read past, unused.

    @property
    def _is_reading_arguments(self) -> bool:
        """Whether the value being read is the arguments (the first arguments key's)."""
        return self._key == self._arguments_key and not self._has_arguments

    def _after_value(self, char: str) -> None:
        if char == ",":
            self._state = _State.KEY_OR_END
        elif char == "}":
            self._state = _State.DONE
        elif char not in WHITESPACE:
            self._state = _State.BROKEN

    @staticmethod
    def _decoded(text: str | list[str]) -> object:
        try:
            return json.loads(text if isinstance(text, str) else "".join(text))
        except ValueError:
            return None

    def take(self) -> list[ParseEvent]:
        """What the characters read since the last call add: the call's start once its name is
        known, then its arguments' new text (``{}`` for a call that gives none)."""
        if not self.is_call:
            return []
        events: list[ParseEvent] = []
        if not self.is_started:
            assert self.name is not None
            self.is_started = True
            events.append(CallStarted(self.name))
        if self._pending:
            events.append(ArgumentsAdded("".join(self._pending)))
            self._pending = []
        elif self.is_done and not self._has_arguments:
            self._has_arguments = True
            events.append(ArgumentsAdded("{}"))
        return events
