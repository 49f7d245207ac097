"""`TextStream`: generated token ids in, text deltas out, cut at the first stop string."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pdserve.tokenizer.detokenizer import (
    DEFAULT_NUM_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    SupportsDecode,
)
from pdserve.tokenizer.stop import StopStringMatcher


class TextDelta(NamedTuple):
    """The text one step of a stream adds.

    Attributes:
        text: New text to send (may be empty while a character or a possible stop string is
            incomplete).
        is_stopped: Whether a stop string was completed; the request should end.
        stop: The stop string that was completed, if any.
    """

    text: str
    is_stopped: bool = False
    stop: str | None = None


class TextStream:
    """Detokenizes one request's generated tokens and applies its stop strings.

    The concatenated deltas equal the decoded text of all tokens, truncated before the first
    stop string completed, or after it with `include_stop` (see `pdserve.tokenizer.stop`).
    Stop token ids (EOS) are not handled here: the engine ends the request on them.

    Args:
        tokenizer: The decoder of the model's tokenizer.
        stop_strings: Strings that end generation; they are not part of the text unless
            `include_stop`.
        skip_special_tokens: Whether special tokens are left out of the text.
        include_stop: The completed stop string ends the text (vLLM's
            ``include_stop_str_in_output``); what follows it is still dropped.
        context_token_ids: The prompt (its last tokens are used as decoding context).
        num_context_tokens: How many context tokens to keep.

    Raises:
        ValueError: If a stop string is empty.
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        stop_strings: Iterable[str] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
        context_token_ids: Sequence[int] = (),
        num_context_tokens: int = DEFAULT_NUM_CONTEXT_TOKENS,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            context_token_ids=context_token_ids,
            num_context_tokens=num_context_tokens,
        )
        self._matcher = StopStringMatcher(stop_strings)
        self._include_stop = include_stop
        self._text_parts: list[str] = []
        self._is_finished = False

    @property
    def text(self) -> str:
        """The text sent so far."""
        return "".join(self._text_parts)

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids received so far."""
        return self._detokenizer.token_ids

    @property
    def is_stopped(self) -> bool:
        """Whether a stop string has been completed."""
        return self._matcher.is_stopped

    def add_tokens(self, token_ids: Iterable[int]) -> TextDelta:
        """Adds generated token ids.

        Returns:
            The text to send now; once stopped, every later call returns an empty stopped
            delta.

        Raises:
            RuntimeError: After `finish`.
        """
        if self._is_finished:
            raise RuntimeError("add_tokens called after finish")
        if self._matcher.is_stopped:
            return TextDelta("", True, self._matcher.stop)
        return self._release(self._detokenizer.add_tokens(token_ids), is_final=False)

    def finish(self) -> TextDelta:
        """Ends the stream (the request finished) and releases all text still held back."""
        was_finished, self._is_finished = self._is_finished, True
        if was_finished or self._matcher.is_stopped:
            return TextDelta("", self._matcher.is_stopped, self._matcher.stop)
        return self._release(self._detokenizer.flush(), is_final=True)

    def _release(self, text: str, *, is_final: bool) -> TextDelta:
        match = self._matcher.push(text)
        released = match.text
        if is_final and not match.is_stopped:
            released += self._matcher.flush()
        if match.is_stopped and self._include_stop:
            released += match.stop or ""
        if released:
            self._text_parts.append(released)
        return TextDelta(released, match.is_stopped, match.stop)
