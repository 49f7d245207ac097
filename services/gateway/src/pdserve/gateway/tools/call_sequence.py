"""Several call objects one after another, in the shapes models write them: ``{...}``,
``[{...}, {...}]``, ``{...}; {...}``, each read by a `CallObject` as the completion streams."""

from __future__ import annotations

import enum
from collections.abc import Container
from typing import NamedTuple

from pdserve.gateway.tools.json_calls import WHITESPACE, CallObject, CallStarted, ParseEvent


class _SequenceState(enum.Enum):
    LEAD = enum.auto()  # before the first object (an optional "[")
    OBJECT = enum.auto()
    BETWEEN = enum.auto()  # after an object: whitespace, ",", ";" or "]"
    STOPPED = enum.auto()


class SequenceStop(NamedTuple):
    """Where a `CallSequence` ended.

    Attributes:
        position: Index (in the text of that `feed`) of the first character not read.
        unread: Text it read that is not part of a call (an object that is not a call).
    """

    position: int
    unread: str


class CallSequence:
    """Call objects one after another: ``{...}``, ``[{...}, {...}]`` or ``{...}; {...}``.

    It stops at the first character that does not belong: an object that is not a call of an
    offered function (its text is handed back unread) or anything but whitespace, ``,``, ``;``
    or ``]`` between objects.
    """

    def __init__(self, arguments_keys: tuple[str, ...], names: Container[str]) -> None:
        self._arguments_keys = arguments_keys
        self._names = names
        self._state = _SequenceState.LEAD
        self._has_bracket = False
        self._call: CallObject | None = None
        self.num_started = 0  # calls started (the last one may be unfinished)

    @property
    def is_stopped(self) -> bool:
        return self._state is _SequenceState.STOPPED

    def feed(self, text: str) -> tuple[list[ParseEvent], SequenceStop | None]:
        """Reads `text`; the events it adds, and where the sequence stopped (None: it goes
        on)."""
        events: list[ParseEvent] = []
        for position, char in enumerate(text):
            state = self._state
            if state is _SequenceState.OBJECT:
                call = self._call
                assert call is not None
                call.push(char)
                taken = call.take()
                self.num_started += sum(isinstance(event, CallStarted) for event in taken)
                events += taken
                if call.is_broken or call.is_rejected or (call.is_done and not call.is_call):
                    self._state = _SequenceState.STOPPED
                    unread = "" if call.is_started else call.raw
                    return events, SequenceStop(position + 1, unread)
                if call.is_done:
                    self._call = None
                    self._state = _SequenceState.BETWEEN
            elif char in WHITESPACE:
                continue
            elif char == "{":
                self._call = CallObject(self._arguments_keys, self._names)
                self._call.push(char)
                self._state = _SequenceState.OBJECT
            elif state is _SequenceState.LEAD and char == "[" and not self._has_bracket:
                self._has_bracket = True
            elif state is _SequenceState.BETWEEN and char in ",;":
                continue
            elif state is _SequenceState.BETWEEN and char == "]" and self._has_bracket:
                self._has_bracket = False
            else:
                self._state = _SequenceState.STOPPED
                return events, SequenceStop(position, "")
        return events, None

    def finish(self) -> str:
        """Ends the sequence at the end of the completion; the text of an unfinished object
        that never became a call (to be shown as content)."""
        call = self._call
        self._state = _SequenceState.STOPPED
        if call is None or call.is_started:
            return ""
        return call.raw
