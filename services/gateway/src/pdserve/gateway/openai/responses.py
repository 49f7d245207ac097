"""OpenAI completion and chat completion bodies and their server-sent events.

`Responder` shapes one request's `OutputDelta`s as a completion or a chat completion: one JSON
body, or chunks sent as server-sent events (``data: <json>``, a blank line) ending in
``data: [DONE]``, with a last usage chunk for ``stream_options.include_usage`` and an in-band
error event when a stream fails after its headers were sent (sent by
`pdserve.gateway.openai.sse.EventStreamResponse`; logprobs shaped in
`pdserve.gateway.openai.logprobs`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from pdserve.common.errors import PdserveError
from pdserve.common.generation import TokenLogprobs
from pdserve.gateway.openai.http import error_body
from pdserve.gateway.openai.logprobs import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    joined_logprobs,
    prompt_logprobs_entries,
)
from pdserve.gateway.openai.logprobs import padded as padded_logprobs
from pdserve.gateway.openai.parsing import OpenAIBody
from pdserve.gateway.openai.sse import sse
from pdserve.gateway.openai.tool_calls import chat_message, tool_call_chunk
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import ApiKind, OutputDelta


class Responder:
    """Shapes one request's choices as a completion or chat completion (stream or not).

    Args:
        kind: `ApiKind.CHAT` (a chat completion) or `ApiKind.COMPLETIONS`.
        prompts: The prepared request of each prompt (one, except a completions prompt list).
        body: The parsed body (model name, stream options).
    """

    def __init__(self, kind: ApiKind, prompts: Sequence[PreparedRequest], body: OpenAIBody) -> None:
        self.kind = kind
        is_chat = kind is ApiKind.CHAT
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
        self._texts = TokenTexts()
        self._num_tokens = [0] * len(self.choices)
        self._text_offsets = [0] * len(self.choices)
        self._finished: dict[int, OutputDelta] = {}

    @property
    def _is_chat(self) -> bool:
        return self.kind is ApiKind.CHAT

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
        scored_ids = padded_logprobs(scored, len(token_ids))
        return text, completion_logprobs(self._texts, prompt.tokenizer, token_ids, scored_ids, 0)

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
            body["prompt_logprobs"] = prompt_logprobs_entries(
                self._texts, self.prompts[0], prompt_logprobs
            )
        body["usage"] = self._usage()
        return body

    def _full_choice(self, index: int, deltas: list[OutputDelta]) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        token_ids = [t for d in deltas for t in d.token_ids]
        logprobs = [lp for d in deltas for lp in padded_logprobs(d.logprobs, len(d.token_ids))]
        prompt_logprobs = [lp for d in deltas for lp in d.prompt_logprobs]
        last = deltas[-1] if deltas else None
        choice: dict[str, Any] = {"index": index, "logprobs": None}
        if self._is_chat:
            choice["message"] = chat_message(text, [c for d in deltas for c in d.tool_calls])
            reasoning = "".join(d.reasoning for d in deltas)
            if reasoning:
                choice["message"]["reasoning_content"] = reasoning
            if self.num_top is not None:
                choice["logprobs"] = chat_logprobs(
                    self._texts, self._prompt(index), token_ids, logprobs
                )
        else:
            echoed, echoed_logprobs = ("", None)
            if self._prompt(index).echo:
                echoed, echoed_logprobs = self._echo(index, prompt_logprobs)
            choice["text"] = echoed + text
            if self.num_top is not None:
                generated = completion_logprobs(
                    self._texts, self._prompt(index).tokenizer, token_ids, logprobs, len(echoed)
                )
                choice["logprobs"] = joined_logprobs(echoed_logprobs, generated)
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
        echo = is_first and self._prompt(index).echo and not self._is_chat
        self._num_tokens[index] += len(delta.token_ids)
        padded = padded_logprobs(delta.logprobs, len(delta.token_ids))
        content_logprobs = None
        if self._is_chat and self.num_top is not None and delta.token_ids:
            content_logprobs = chat_logprobs(
                self._texts, self._prompt(index), delta.token_ids, padded
            )
            if not content_logprobs["content"]:
                content_logprobs = None  # NOTE: only special tokens (the end of the turn)
        shows_tokens = (
            self.return_token_ids
            or self.continuous_usage
            or (self.num_top is not None and (not self._is_chat or content_logprobs is not None))
        )
        if not (
            delta.text
            or (delta.token_ids and shows_tokens)
            or delta.tool_calls
            or delta.reasoning
            or delta.finish_reason
            or (is_first and self._is_chat)
            or echo
        ):
            return None
        choice: dict[str, Any] = {"index": index}
        logprobs: Any = content_logprobs
        if self._is_chat:
            content: dict[str, Any] = {"role": "assistant"} if is_first else {}
            if delta.reasoning:
                content["reasoning_content"] = delta.reasoning
            if delta.text or (is_first and not delta.reasoning):
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
                generated = completion_logprobs(
                    self._texts, self._prompt(index).tokenizer, delta.token_ids, padded, offset
                )
                logprobs = joined_logprobs(echoed_logprobs, generated)
        choice["logprobs"] = logprobs
        choice["finish_reason"] = delta.finish_reason.value if delta.finish_reason else None
        if self.return_token_ids:
            if is_first:
                choice["prompt_token_ids"] = list(self._prompt(index).prompt_token_ids)
            choice["token_ids"] = list(delta.token_ids)
        body = self._envelope(self.object_name + (".chunk" if self._is_chat else ""), [choice])
        if is_first and self.wants_prompt_logprobs and not echo and delta.prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_entries(
                self._texts, self._prompt(index), delta.prompt_logprobs
            )
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
        body = self._envelope(self.object_name + (".chunk" if self._is_chat else ""), [])
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

        def rendered(index: int, delta: OutputDelta) -> list[str]:
            events = self.render(index, delta, index in not_started)
            if events:
                not_started.discard(index)
            return events

        try:
            for event in rendered(*first):
                yield event
            async for index, delta in deltas:
                for event in rendered(index, delta):
                    yield event
        except PdserveError as error:
            # NOTE: the headers are sent already; report the error in-band, as vLLM does.
            message = error.message or error.reason.name
            yield sse(error_body(message, error.http_status, error.reason.name.lower()))
        finally:
            await deltas.aclose()
        yield sse("[DONE]")
