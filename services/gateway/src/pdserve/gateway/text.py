"""Completion text: incremental detokenization with stop strings matched across tokens.

Wraps `pdserve.tokenizer.TextStream` and adds what the gateway needs from it: which token
completed a stop string (the completion ends with that token, so usage counts it and tokens
after it are dropped), and the text each token chunk releases. `MarkupDecoder` keeps the
special tokens a chat format's parser reads (harmony's ``<|channel|>``...) in the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pdserve.tokenizer import SupportsDecode, TextStream, Tokenizer


def markup_skips(tokenizer: Tokenizer, markup_tokens: Sequence[str]) -> frozenset[int] | None:
    """The special token ids to leave out of a completion whose parser reads `markup_tokens`:
    every special token but those; None when none of them is special (a plain decode keeps
    them)."""
    if not markup_tokens:
        return None
    special = tokenizer.special_token_ids
    kept = {tokenizer.token_to_id(token) for token in markup_tokens} & special
    return special - kept if kept else None


class MarkupDecoder:
    """Decodes as `tokenizer` does, except that a decode without special tokens keeps those
    not in `skipped` (a format's markup).

    Args:
        tokenizer: The model's tokenizer.
        skipped: The special token ids still left out (`markup_skips`).
    """

    def __init__(self, tokenizer: SupportsDecode, skipped: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._skipped = skipped

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self._skipped]
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)


class TextStep(NamedTuple):
    """What one chunk of tokens adds to the completion.

    Attributes:
        text: Text released now (may lag the tokens: an incomplete character or a possible
            stop string is held back).
        token_ids: The chunk's tokens that belong to the completion (all of them, unless a
            stop string completed inside the chunk: then up to the token that completed it).
        is_stopped: A stop string completed; the completion ends here.
    """

    text: str
    token_ids: tuple[int, ...]
    is_stopped: bool = False


class CompletionText:
    """Detokenizes one completion.

    Args:
        tokenizer: The model's tokenizer.
        prompt_token_ids: The prompt (its tail is decoding context for the first tokens).
        stop: Stop strings; the text ends before the first one completed (after it with
            `include_stop`).
        skip_special_tokens: Leave special tokens (EOS, role markers) out of the text.
        include_stop: The completed stop string is the end of the text.
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._has_stop_strings = bool(stop)
        self._stream = TextStream(
            tokenizer,
            stop,
            skip_special_tokens=skip_special_tokens,
            include_stop=include_stop,
            context_token_ids=prompt_token_ids,
        )
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Completion tokens accepted so far."""
        return self._num_tokens

    @property
    def text(self) -> str:
        """The text released so far."""
        return self._stream.text

    @property
    def is_stopped(self) -> bool:
        """Whether a stop string ended the completion."""
        return self._stream.is_stopped

    def add(self, token_ids: Sequence[int]) -> TextStep:
        """Adds the next tokens of the completion.

        Raises:
            RuntimeError: After a stop string or `finish`.
        """
        if self._stream.is_stopped:
            raise RuntimeError("tokens added after a stop string ended the completion")
        if not self._has_stop_strings:
            delta = self._stream.add_tokens(token_ids)
            self._num_tokens += len(token_ids)
            return TextStep(delta.text, tuple(token_ids))
        parts: list[str] = []
        for count, token_id in enumerate(token_ids, start=1):
            delta = self._stream.add_tokens((token_id,))
            parts.append(delta.text)
            if delta.is_stopped:
                self._num_tokens += count
                return TextStep("".join(parts), tuple(token_ids[:count]), is_stopped=True)
        self._num_tokens += len(token_ids)
        return TextStep("".join(parts), tuple(token_ids))

    def finish(self) -> str:
        """Ends the completion and returns the text still held back."""
        return self._stream.finish().text
