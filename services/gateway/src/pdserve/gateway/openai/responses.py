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
from collections.abc import AsyncGenerator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.common.errors import PdserveError
from pdserve.gateway.access.admission import Admission
from pdserve.gateway.openai.http import error_body
from pdserve.gateway.openai.parsing import OpenAIBody
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import OutputDelta

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: <compact JSON or the string>`` and a blank line."""
    payload = (
        data
        if isinstance(data, str)
        else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    )
    return f"data: {payload}\n\n"


def _usage(delta: OutputDelta) -> dict[str, Any] | None:
    if delta.usage is None:
        return None
    usage: dict[str, Any] = {
        "prompt_tokens": delta.usage.num_prompt_tokens,
        "completion_tokens": delta.usage.num_completion_tokens,
        "total_tokens": delta.usage.num_total_tokens,
    }
    if delta.usage.num_cached_prompt_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": delta.usage.num_cached_prompt_tokens}
    return usage


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
    """Shapes one request's deltas as a completion or chat completion (stream or not)."""

    def __init__(self, is_chat: bool, prepared: PreparedRequest, body: OpenAIBody) -> None:
        self.is_chat = is_chat
        self.prepared = prepared
        self.model = body.model
        self.return_token_ids = body.return_token_ids
        self.include_usage = body.include_usage
        self.response_id = ("chatcmpl-" if is_chat else "cmpl-") + prepared.request_id
        self.created = int(time.time())
        self.object_name = "chat.completion" if is_chat else "text_completion"

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, deltas: list[OutputDelta]) -> dict[str, Any]:
        """The non-streamed response body."""
        text = "".join(d.text for d in deltas)
        last = deltas[-1]
        choice: dict[str, Any] = {"index": 0, "logprobs": None}
        if self.is_chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["finish_reason"] = last.finish_reason.value if last.finish_reason else None
        if self.return_token_ids:
            choice["prompt_token_ids"] = list(self.prepared.prompt_token_ids)
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        body = self._envelope(self.object_name, [choice])
        body["usage"] = _usage(last)
        return body

    def chunk(self, delta: OutputDelta, is_first: bool) -> dict[str, Any] | None:
        """One streamed chunk, or None when the delta carries nothing to send."""
        if not (
            delta.text or delta.token_ids or delta.finish_reason or (is_first and self.is_chat)
        ):
            return None
        choice: dict[str, Any] = {"index": 0}
        if self.is_chat:
            content: dict[str, Any] = {"role": "assistant"} if is_first else {}
            if delta.text or is_first:
                content["content"] = delta.text
            choice["delta"] = content
        else:
            choice["text"] = delta.text
        choice["logprobs"] = None
        choice["finish_reason"] = delta.finish_reason.value if delta.finish_reason else None
        if self.return_token_ids:
            if is_first:
                choice["prompt_token_ids"] = list(self.prepared.prompt_token_ids)
            choice["token_ids"] = list(delta.token_ids)
        body = self._envelope(self.object_name + (".chunk" if self.is_chat else ""), [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, delta: OutputDelta) -> dict[str, Any]:
        """The final chunk of ``stream_options.include_usage``: no choices, the usage."""
        body = self._envelope(self.object_name + (".chunk" if self.is_chat else ""), [])
        body["usage"] = _usage(delta)
        return body

    def render(self, delta: OutputDelta, is_first: bool) -> list[str]:
        """The SSE events of one delta (none when it carries nothing)."""
        events = []
        chunk = self.chunk(delta, is_first)
        if chunk is not None:
            events.append(_sse(chunk))
        if delta.finish_reason is not None and self.include_usage:
            events.append(_sse(self.usage_chunk(delta)))
        return events

    async def events(
        self, first: OutputDelta, deltas: AsyncGenerator[OutputDelta, None]
    ) -> AsyncGenerator[str, None]:
        """The SSE events of a stream whose first delta was already received."""
        try:
            rendered = self.render(first, is_first=True)
            is_first = not rendered
            for event in rendered:
                yield event
            async for delta in deltas:
                rendered = self.render(delta, is_first)
                is_first = is_first and not rendered
                for event in rendered:
                    yield event
        except PdserveError as error:
            # NOTE: the headers are sent already; report the error in-band, as vLLM does.
            message = error.message or error.reason.name
            yield _sse(error_body(message, error.http_status, error.reason.name.lower()))
        finally:
            await deltas.aclose()
        yield _sse("[DONE]")
