"""Stop strings over streamed text: find them across chunk boundaries and cut the text there.

Generation stops as soon as any stop string has been produced. Text is streamed in chunks
(one per detokenized step) and a stop string may be split over several of them, so the
matcher holds back the longest tail that could still grow into a stop string and releases it
once it cannot. The result depends only on the text, never on how it was chunked: it is the
text up to the first stop string to be completed (the one ending first; if several end at
the same character, the longest), without the stop string itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


def partial_tail(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `markers`: what a
    streaming reader holds back, as it may still grow into the marker."""
    longest = 0
    for marker in markers:
        for length in range(min(len(text), len(marker) - 1), longest, -1):
            if marker.startswith(text[-length:]):
                longest = length
                break
    return longest


class StopMatch(NamedTuple):
    """What one chunk of text releases.

    Attributes:
        text: Text that is safe to send on (never part of a stop string).
        is_stopped: Whether a stop string was completed; nothing follows `text` then.
        stop: The stop string that was completed, if any.
    """

    text: str
    is_stopped: bool = False
    stop: str | None = None


class StopStringMatcher:
    """Finds the first stop string in streamed text and truncates the text before it.

    Args:
        stop_strings: The stop strings; duplicates are ignored.

    Raises:
        ValueError: If a stop string is empty.
    """

    def __init__(self, stop_strings: Iterable[str]) -> None:
        self._stop_strings = tuple(dict.fromkeys(stop_strings))
        if any(not stop for stop in self._stop_strings):
            raise ValueError("stop strings must not be empty")
        self._held = ""
        self._stop: str | None = None
        self._is_stopped = False

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings matched, in the order given."""
        return self._stop_strings

    @property
    def is_stopped(self) -> bool:
        """Whether a stop string has been completed."""
        return self._is_stopped

    @property
    def stop(self) -> str | None:
        """The stop string that was completed, if any."""
        return self._stop

    @property
    def held_text(self) -> str:
        """Text held back because it may be the start of a stop string."""
        return self._held

    def push(self, text: str) -> StopMatch:
        """Adds a chunk of text.

        Returns:
            The text that can be released now, and whether (and by which string) the stream
            stopped. After a stop, further chunks release nothing.
        """
        if self._is_stopped:
            return StopMatch("", True, self._stop)
        buffer = self._held + text
        match = self._first_stop(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            self._is_stopped = True
            self._stop = stop
            return StopMatch(buffer[:start], True, stop)
        num_held = partial_tail(buffer, self._stop_strings)
        self._held = buffer[len(buffer) - num_held :]
        return StopMatch(buffer[: len(buffer) - num_held])

    def flush(self) -> str:
        """Ends the stream: releases the held-back tail, which can no longer become a stop."""
        held, self._held = self._held, ""
        return "" if self._is_stopped else held

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop that ends first; the longest on a tie."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stop_strings:
            start = buffer.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), -len(stop), stop)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None
        end, negative_length, stop = best
        return end + negative_length, stop
