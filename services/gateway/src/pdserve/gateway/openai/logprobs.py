"""Logprobs in OpenAI's shapes: a chat choice's ``logprobs.content``, a completion's
``logprobs`` (tokens, values, alternatives, text offsets) and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.common.generation import TokenLogprobs
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.tokenizer import Tokenizer


class TokenTexts:
    """Each token's text, decoded once per response."""

    def __init__(self) -> None:
        self._texts: dict[int, str] = {}

    def text(self, tokenizer: Tokenizer, token_id: int) -> str:
        """The token's text, special tokens included."""
        text = self._texts.get(token_id)
        if text is None:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


def chat_logprobs(
    texts: TokenTexts,
    prompt: PreparedRequest,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs | None],
) -> dict[str, Any]:
    """``choices[i].logprobs`` of chat: one entry per token of ``message.content``, with
    its alternatives (a token the content leaves out, a special token or the stop token, is
    left out here too, so the entries' ``token`` strings join to the content, as OpenAI's
    do)."""
    tokenizer = prompt.tokenizer

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts.text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for token_id, scored in zip(token_ids, padded(logprobs, len(token_ids)), strict=True):
        if scored is None or prompt.leaves_out(token_id):
            continue
        item = entry(token_id, scored.logprob)
        item["top_logprobs"] = [entry(t, value) for t, value in scored.top]
        content.append(item)
    return {"content": content, "refusal": None}


def completion_logprobs(
    texts: TokenTexts,
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprobs | None],
    offset: int,
) -> dict[str, Any]:
    """``choices[i].logprobs`` of a completion: tokens, their logprobs, each position's
    most likely tokens (the chosen one included, as OpenAI does) and text offsets."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, scored in zip(token_ids, logprobs, strict=True):
        text = texts.text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if scored is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(scored.logprob)
        top = {texts.text(tokenizer, t): value for t, value in scored.top}
        top.setdefault(text, scored.logprob)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_logprobs_entries(
    texts: TokenTexts, prompt: PreparedRequest, prompt_logprobs: Sequence[TokenLogprobs]
) -> list[dict[str, Any] | None]:
    """The ``prompt_logprobs`` extension (as vLLM): None for the first prompt token, then
    ``{token id: {"logprob", "decoded_token"}}`` of each token and its alternatives."""
    result: list[dict[str, Any] | None] = [None]
    for token_id, scored in zip(prompt.prompt_token_ids[1:], prompt_logprobs, strict=False):
        entries = {token_id: scored.logprob, **dict(scored.top)}
        result.append(
            {
                str(t): {
                    "logprob": value,
                    "decoded_token": texts.text(prompt.tokenizer, t),
                }
                for t, value in entries.items()
            }
        )
    return result


def padded(logprobs: Sequence[TokenLogprobs | None], length: int) -> list[TokenLogprobs | None]:
    """`logprobs` cut or padded with None to `length` (an instance that sent none)."""
    return [*logprobs[:length], *[None] * (length - len(logprobs))]


def joined_logprobs(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two completions logprobs objects as one (the echoed prompt's, then the completion's,
    whose text offsets already start after the prompt)."""
    if first is None:
        return second
    return {key: [*first[key], *second[key]] for key in second}
