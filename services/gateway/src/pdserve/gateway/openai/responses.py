"""OpenAI response bodies and their server-sent events.

`Responder` shapes one request's `OutputDelta`s as a completion or a chat completion: one JSON
body, or chunks sent as server-sent events (``data: <json>``, a blank line) ending in
``data: [DONE]``, with a last usage chunk for ``stream_options.include_usage`` and an in-band
error event when a stream fails after its headers were sent. `EventStreamResponse` sends such
a stream and gives back the request's admission when it ends, even on client disconnect.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.common.errors import PdserveError
from pdserve.common.generation import TokenLogprobs
from pdserve.gateway.access.admission import Admission
from pdserve.gateway.openai.http import error_body
from pdserve.gateway.openai.parsing import OpenAIBody
from pdserve.gateway.openai.tool_calls import chat_message, tool_call_chunk
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import OutputDelta
from pdserve.tokenizer import Tokenizer

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <compact JSON or the string>`` and a blank line."""
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {payload}\n\n"


class EventStreamResponse(StreamingResponse):
    """An SSE response that always closes its event generator and gives back its admission,
    even on client disconnect."""

    def __init__(
        self, events: AsyncGenerator[str, None], headers: dict[str, str], admission: Admission
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        self._events = events
        self._admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._admission.release()
            await self._events.aclose()


class Responder:
    """Shapes one request's choices as a completion or chat completion (stream or not).

    Args:
        is_chat: Chat completion (else completion).
        prompts: The prepared request of each prompt (one, except a completions prompt list).
        body: The parsed body (model name, stream options).
    """

    def __init__(self, is_chat: bool, prompts: Sequence[PreparedRequest], body: OpenAIBody) -> None:
        self.is_chat = is_chat
        self.prompts = list(prompts)
        self.choices = [choice for prompt in self.prompts for choice in prompt.choices()]
        self.n = self.prompts[0].n
        self.model = body.model
        self.return_token_ids = body.return_token_ids
        self.include_usage = body.include_usage
        self.continuous_usage = body.continuous_usage
        self.response_id = ("chatcmpl-" if is_chat else "cmpl-") + self.prompts[0].request_id
        self.created = int(time.time())
        self.object_name = "chat.completion" if is_chat else "text_completion"
        sampling = self.prompts[0].request.sampling
        self.num_top = sampling.logprobs
        self.wants_prompt_logprobs = sampling.prompt_logprobs is not None
        self._token_texts: dict[int, str] = {}
        self._is_special: dict[int, bool] = {}
        self._num_tokens = [0] * len(self.choices)
        self._text_offsets = [0] * len(self.choices)
        self._finished: dict[int, OutputDelta] = {}

    def _prompt(self, index: int) -> PreparedRequest:
        return self.prompts[index // self.n]

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # ---- logprobs ---------------------------------------------------------------------------

    def _text_of(self, tokenizer: Tokenizer, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _is_special_token(self, tokenizer: Tokenizer, token_id: int) -> bool:
        """Whether the token is one the text leaves out (EOS, an end of turn such as
        ``<|im_end|>``): it has text of its own but none among the completion's."""
        is_special = self._is_special.get(token_id)
        if is_special is None:
            is_special = bool(self._text_of(tokenizer, token_id)) and not tokenizer.decode(
                [token_id], skip_special_tokens=True
            )
            self._is_special[token_id] = is_special
        return is_special

    def _chat_logprobs(
        self, index: int, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None]
    ) -> dict[str, Any]:
        """``choices[i].logprobs`` of chat: one entry per token of ``message.content``, with
        its alternatives (a special token, left out of the content, is left out here too, so
        the entries' ``token`` strings join to the content, as OpenAI's do)."""
        tokenizer = self._prompt(index).tokenizer

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._text_of(tokenizer, token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = []
        for token_id, scored in zip(token_ids, _padded(logprobs, len(token_ids)), strict=True):
            if scored is None or self._is_special_token(tokenizer, token_id):
                continue
            item = entry(token_id, scored.logprob)
            item["top_logprobs"] = [entry(t, value) for t, value in scored.top]
            content.append(item)
        return {"content": content, "refusal": None}

    def _completion_logprobs(
        self,
        index: int,
        token_ids: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None],
        offset: int,
    ) -> dict[str, Any]:
        """``choices[i].logprobs`` of a completion: tokens, their logprobs, each position's
        most likely tokens (the chosen one included, as OpenAI does) and text offsets."""
        tokenizer = self._prompt(index).tokenizer
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, scored in zip(token_ids, logprobs, strict=True):
            text = self._text_of(tokenizer, token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if scored is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(scored.logprob)
            top = {self._text_of(tokenizer, t): value for t, value in scored.top}
            top.setdefault(text, scored.logprob)
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _echo(self, index: int, prompt_logprobs: Sequence[TokenLogprobs]) -> tuple[str, Any]:
        """The echoed prompt's text and (when asked) its logprobs, the first token's None."""
        prompt = self._prompt(index)
        token_ids = prompt.prompt_token_ids
        text = prompt.prompt_text
        if text is None:
            text = prompt.tokenizer.decode(token_ids, skip_special_tokens=False)
        if self.num_top is None:
            return text, None
        scored: list[TokenLogprobs | None] = [None, *prompt_logprobs]
        return text, self._completion_logprobs(index, token_ids, _padded(scored, len(token_ids)), 0)

    def _prompt_logprobs(
        self, index: int, prompt_logprobs: Sequence[TokenLogprobs]
    ) -> list[dict[str, Any] | None]:
        """The ``prompt_logprobs`` extension (as vLLM): None for the first prompt token, then
        ``{token id: {"logprob", "decoded_token"}}`` of each token and its alternatives."""
        prompt = self._prompt(index)
        result: list[dict[str, Any] | None] = [None]
        for token_id, scored in zip(prompt.prompt_token_ids[1:], prompt_logprobs, strict=False):
            entries = {token_id: scored.logprob, **dict(scored.top)}
            result.append(
                {
                    str(t): {
                        "logprob": value,
                        "decoded_token": self._text_of(prompt.tokenizer, t),
                    }
                    for t, value in entries.items()
                }
            )
        return result

    # ---- bodies -----------------------------------------------------------------------------

    def _usage(self) -> dict[str, Any]:
        """Usage of the whole request: each prompt once, every choice's completion."""
        finals = [d.usage for d in self._finished.values() if d.usage is not None]
        prompt_tokens = sum(len(p.prompt_token_ids) for p in self.prompts)
        completion_tokens = sum(u.num_completion_tokens for u in finals)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        # NOTE: a prompt's cache hits, once per prompt (its first choice's).
        cached = 0
        for first_choice in range(0, len(self.choices), self.n):
            final = self._finished.get(first_choice)
            if final is not None and final.usage is not None:
                cached += final.usage.num_cached_prompt_tokens
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def full(self, deltas: list[tuple[int, OutputDelta]]) -> dict[str, Any]:
        """The non-streamed response body."""
        per_choice: list[list[OutputDelta]] = [[] for _ in self.choices]
        for index, delta in deltas:
            per_choice[index].append(delta)
            if delta.finish_reason is not None:
                self._finished[index] = delta
        choices = [self._full_choice(i, d) for i, d in enumerate(per_choice)]
        body = self._envelope(self.object_name, choices)
        prompt_logprobs = [lp for d in per_choice[0] for lp in d.prompt_logprobs]
        if self.wants_prompt_logprobs and not self.prompts[0].echo:
            body["prompt_logprobs"] = self._prompt_logprobs(0, prompt_logprobs)
        body["usage"] = self._usage()
        return body

    def _full_choice(self, index: int, deltas: list[OutputDelta]) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        token_ids = [t for d in deltas for t in d.token_ids]
        logprobs = [lp for d in deltas for lp in _padded(d.logprobs, len(d.token_ids))]
        prompt_logprobs = [lp for d in deltas for lp in d.prompt_logprobs]
        last = deltas[-1] if deltas else None
        choice: dict[str, Any] = {"index": index, "logprobs": None}
        if self.is_chat:
            choice["message"] = chat_message(text, [c for d in deltas for c in d.tool_calls])
            if self.num_top is not None:
                choice["logprobs"] = self._chat_logprobs(index, token_ids, logprobs)
        else:
            echoed, echoed_logprobs = ("", None)
            if self._prompt(index).echo:
                echoed, echoed_logprobs = self._echo(index, prompt_logprobs)
            choice["text"] = echoed + text
            if self.num_top is not None:
                generated = self._completion_logprobs(index, token_ids, logprobs, len(echoed))
                choice["logprobs"] = _joined(echoed_logprobs, generated)
        choice["finish_reason"] = (
            last.finish_reason.value if last is not None and last.finish_reason else None
        )
        if self.return_token_ids:
            choice["prompt_token_ids"] = list(self._prompt(index).prompt_token_ids)
            choice["token_ids"] = token_ids
        return choice

    def chunk(self, index: int, delta: OutputDelta, is_first: bool) -> dict[str, Any] | None:
        """One streamed chunk of choice `index`, or None when the delta carries nothing the
        client sees (tokens whose text is held back, in a call's markup for instance, show
        only with token ids, logprobs or usage on every chunk)."""
        echo = is_first and self._prompt(index).echo and not self.is_chat
        self._num_tokens[index] += len(delta.token_ids)
        padded = _padded(delta.logprobs, len(delta.token_ids))
        chat_logprobs = None
        if self.is_chat and self.num_top is not None and delta.token_ids:
            chat_logprobs = self._chat_logprobs(index, delta.token_ids, padded)
            if not chat_logprobs["content"]:
                chat_logprobs = None  # NOTE: only special tokens (the end of the turn)
        shows_tokens = (
            self.return_token_ids
            or self.continuous_usage
            or (self.num_top is not None and (not self.is_chat or chat_logprobs is not None))
        )
        if not (
            delta.text
            or (delta.token_ids and shows_tokens)
            or delta.tool_calls
            or delta.finish_reason
            or (is_first and self.is_chat)
            or echo
        ):
            return None
        choice: dict[str, Any] = {"index": index}
        logprobs: Any = chat_logprobs
        if self.is_chat:
            content: dict[str, Any] = {"role": "assistant"} if is_first else {}
            if delta.text or is_first:
                content["content"] = delta.text
            if delta.tool_calls:
                content["tool_calls"] = [tool_call_chunk(call) for call in delta.tool_calls]
            choice["delta"] = content
        else:
            echoed, echoed_logprobs = ("", None)
            if echo:
                echoed, echoed_logprobs = self._echo(index, delta.prompt_logprobs)
            choice["text"] = echoed + delta.text
            offset = self._text_offsets[index] + len(echoed)
            self._text_offsets[index] = offset + len(delta.text)
            if self.num_top is not None:
                generated = self._completion_logprobs(index, delta.token_ids, padded, offset)
                logprobs = _joined(echoed_logprobs, generated)
        choice["logprobs"] = logprobs
        choice["finish_reason"] = delta.finish_reason.value if delta.finish_reason else None
        if self.return_token_ids:
            if is_first:
                choice["prompt_token_ids"] = list(self._prompt(index).prompt_token_ids)
            choice["token_ids"] = list(delta.token_ids)
        body = self._envelope(self.object_name + (".chunk" if self.is_chat else ""), [choice])
        if is_first and self.wants_prompt_logprobs and not echo and delta.prompt_logprobs:
            body["prompt_logprobs"] = self._prompt_logprobs(index, delta.prompt_logprobs)
        if self.continuous_usage:
            num_prompt_tokens = len(self._prompt(index).prompt_token_ids)
            body["usage"] = {
                "prompt_tokens": num_prompt_tokens,
                "completion_tokens": self._num_tokens[index],
                "total_tokens": num_prompt_tokens + self._num_tokens[index],
            }
        elif self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict[str, Any]:
        """The final chunk of ``stream_options.include_usage``: no choices, the usage."""
        body = self._envelope(self.object_name + (".chunk" if self.is_chat else ""), [])
        body["usage"] = self._usage()
        return body

    def render(self, index: int, delta: OutputDelta, is_first: bool) -> list[str]:
        """The SSE events of one delta of choice `index` (none when it carries nothing); the
        usage chunk follows the last choice's end."""
        events = []
        chunk = self.chunk(index, delta, is_first)
        if chunk is not None:
            events.append(sse(chunk))
        if delta.finish_reason is not None:
            self._finished[index] = delta
            if self.include_usage and len(self._finished) == len(self.choices):
                events.append(sse(self.usage_chunk()))
        return events

    async def events(
        self,
        first: tuple[int, OutputDelta],
        deltas: AsyncGenerator[tuple[int, OutputDelta], None],
    ) -> AsyncGenerator[str, None]:
        """The SSE events of a stream whose first delta was already received."""
        not_started = set(range(len(self.choices)))
        try:
            async for index, delta in _prepend(first, deltas):
                rendered = self.render(index, delta, index in not_started)
                if rendered:
                    not_started.discard(index)
                for event in rendered:
                    yield event
        except PdserveError as error:
            # NOTE: the headers are sent already; report the error in-band, as vLLM does.
            message = error.message or error.reason.name
            yield sse(error_body(message, error.http_status, error.reason.name.lower()))
        finally:
            await deltas.aclose()
        yield sse("[DONE]")


async def _prepend(
    first: tuple[int, OutputDelta], rest: AsyncGenerator[tuple[int, OutputDelta], None]
) -> AsyncGenerator[tuple[int, OutputDelta], None]:
    yield first
    async for item in rest:
        yield item


def _padded(logprobs: Sequence[TokenLogprobs | None], length: int) -> list[TokenLogprobs | None]:
    """`logprobs` cut or padded with None to `length` (an instance that sent none)."""
    return [*logprobs[:length], *[None] * (length - len(logprobs))]


def _joined(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two completions logprobs objects as one (the echoed prompt's, then the completion's,
    whose text offsets already start after the prompt)."""
    if first is None:
        return second
    return {key: [*first[key], *second[key]] for key in second}
