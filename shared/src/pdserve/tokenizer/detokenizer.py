"""Incremental detokenization: token ids in, text deltas out, never half a character.

Decoding each new token on its own is wrong for byte-level BPE and byte-fallback
tokenizers, where one character may span several tokens and a token may hold a fragment
of a character. As in vLLM, the detokenizer decodes a short window of recent tokens twice
(with and without the new ones) and emits the difference, and holds the new text back while
it ends in U+FFFD, which is what an incomplete UTF-8 sequence decodes to. The window starts
at the last position where the text was whole, so the deltas concatenate exactly to the
decoded text of all tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

DEFAULT_NUM_CONTEXT_TOKENS = 6
"""Prompt tokens kept as decoding context (enough for any tokenizer's merge of a space)."""


class SupportsDecode(Protocol):
    """Anything that decodes token ids to text, such as `pdserve.tokenizer.Tokenizer`."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Decodes token ids to text; invalid UTF-8 becomes U+FFFD."""
        ...


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Without context, the deltas plus `flush` concatenate to ``decode(all token ids)``. With
    `context_token_ids` (the end of the prompt), they concatenate to the text the generated
    tokens add after that context, which keeps the leading space of the first generated
    word for SentencePiece-style tokenizers.

    Args:
        tokenizer: The decoder of the model's tokenizer.
        skip_special_tokens: Whether special tokens (EOS, role markers...) are left out.
        context_token_ids: Tokens that precede the generated ones (e.g. the prompt); only the
            last `num_context_tokens` are used.
        num_context_tokens: How many context tokens to keep.
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        *,
        skip_special_tokens: bool = True,
        context_token_ids: Sequence[int] = (),
        num_context_tokens: int = DEFAULT_NUM_CONTEXT_TOKENS,
    ) -> None:
        if num_context_tokens < 0:
            raise ValueError(f"num_context_tokens must be >= 0, got {num_context_tokens}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(context_token_ids)[-num_context_tokens:] if num_context_tokens else []
        # NOTE: _token_ids = context + generated; text before _read_offset has been emitted and
        # _prefix_offset..._read_offset is the already-emitted window kept as decoding context.
        self._token_ids: list[int] = context
        self._num_context_tokens = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text_parts: list[str] = []
        self._is_flushed = False

    @property
    def token_ids(self) -> list[int]:
        """The generated token ids received so far (without the context)."""
        return self._token_ids[self._num_context_tokens :]

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self._text_parts)

    @property
    def num_held_tokens(self) -> int:
        """Generated tokens received whose text has not been emitted yet."""
        return len(self._token_ids) - self._read_offset

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Adds generated token ids and returns the text they complete.

        Args:
            token_ids: One or more new token ids, in order.

        Returns:
            The new text; empty while the text so far ends in an incomplete character (or
            the new tokens produce no text, like skipped special tokens).

        Raises:
            RuntimeError: After `flush`.
        """
        if self._is_flushed:
            raise RuntimeError("add_tokens called after flush")
        self._token_ids.extend(int(token_id) for token_id in token_ids)
        return self._advance(is_final=False)

    def flush(self) -> str:
        """Ends the stream and returns any text still held back.

        A stream that really ends inside a character yields U+FFFD here, exactly as the
        decoding of all its tokens does.
        """
        if self._is_flushed:
            return ""
        self._is_flushed = True
        return self._advance(is_final=True)

    def _advance(self, *, is_final: bool) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        decode = self._tokenizer.decode
        window = self._token_ids[self._prefix_offset :]
        prefix_text = decode(
            window[: self._read_offset - self._prefix_offset], self._skip_special_tokens
        )
        new_text = decode(window, self._skip_special_tokens)
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(REPLACEMENT_CHAR) and not is_final:
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._text_parts.append(delta)
        return delta
