"""The Responses API's output: one ``Response`` object, or its stream of typed events.

A response's output items are a ``reasoning`` item for what the reasoning parser read out
(if any), an assistant ``message`` (id ``msg_<request id>``) with one ``output_text`` part for
the text, and a ``function_call`` item for each tool call
(`pdserve.gateway.openai.responses_api.items`). It is ``completed`` (also when it ended by
calls), or ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` when the
completion ran out of tokens. A stream sends, as server-sent events ``event: <type>`` /
``data: <json>`` with a ``sequence_number`` counted from 0:

    response.created, response.in_progress, then for each item in turn
    response.output_item.added, its content (a message: response.content_part.added,
    response.output_text.delta per piece of new text, response.output_text.done,
    response.content_part.done; a reasoning item the same with response.reasoning_text.delta
    and response.reasoning_text.done; a call: response.function_call_arguments.delta per piece of
    its arguments, response.function_call_arguments.done), response.output_item.done; and
    response.completed (or response.incomplete)

and nothing after it (no ``[DONE]``). A request that fails once the events have started ends
with ``error`` and ``response.failed`` (whose response carries the ``error``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from pdserve.common.errors import PdserveError
from pdserve.common.generation import FinishReason
from pdserve.gateway.openai.logprobs import TokenTexts, chat_logprobs, padded
from pdserve.gateway.openai.responses_api.convert import ResponsesBody
from pdserve.gateway.openai.responses_api.items import Event, OutputItems
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import OutputDelta, ResponseStatus

RESPONSE_ID_PREFIX = "resp_"


class ResponseWriter:
    """Shapes one request's deltas as a ``Response`` object or its events.

    Args:
        prompt: The prepared request.
        body: The parsed body (model name, the settings the response repeats).
        now: Wall clock for ``created_at`` and ``completed_at``.
        created_at: When the response was created (a stored one's); None: now.
        completed_at: When it ended (a stored one's); None: when the writer sees the end.
    """

    def __init__(
        self,
        prompt: PreparedRequest,
        body: ResponsesBody,
        now: Callable[[], float] = time.time,
        created_at: float | None = None,
        completed_at: float | None = None,
    ) -> None:
        self.prompt = prompt
        self.response_id = response_id(prompt.request_id)
        self._body = body
        self._now = now
        self._created_at = int(now() if created_at is None else created_at)
        self._completed_at = completed_at
        self._sequence_number = 0
        self._wants_logprobs = prompt.request.sampling.logprobs is not None
        self._texts = TokenTexts()

    # ---- objects ----------------------------------------------------------------------------

    def response(
        self,
        status: ResponseStatus,
        items: OutputItems | None = None,
        final: OutputDelta | None = None,
        error: PdserveError | None = None,
        with_text: bool = False,
    ) -> dict[str, Any]:
        """The ``Response`` object: `items` None has no output yet; `final` (the last delta)
        gives the usage, `error` the failure; `with_text` shows an in-progress message's text
        so far (a polled response; in events it comes as deltas)."""
        sampling = self.prompt.request.sampling
        is_done = status not in (ResponseStatus.IN_PROGRESS, ResponseStatus.QUEUED)
        completed_at = self._now() if self._completed_at is None else self._completed_at
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self._created_at,
            "completed_at": int(completed_at) if is_done and error is None else None,
            "status": status,
            "background": self._body.background,
            "error": None if error is None else _error(error),
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == ResponseStatus.INCOMPLETE else None
            ),
            "model": self._body.model,
            "output": [] if items is None else items.output(_item_status(status), with_text),
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": self._body.store,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "usage": None if final is None else self._usage(final),
            **self._body.echoed,
        }
        return body

    def _usage(self, final: OutputDelta) -> dict[str, Any]:
        num_input_tokens = len(self.prompt.prompt_token_ids)
        usage = final.usage
        num_output_tokens = 0 if usage is None else usage.num_completion_tokens
        num_cached_tokens = 0 if usage is None else usage.num_cached_prompt_tokens
        return {
            "input_tokens": num_input_tokens,
            "input_tokens_details": {"cached_tokens": num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_input_tokens + num_output_tokens,
        }

    def full(self, deltas: list[tuple[int, OutputDelta]]) -> dict[str, Any]:
        """The non-streamed ``Response`` object of all of a request's deltas."""
        items = OutputItems(self.prompt.request_id)
        for _, delta in deltas:
            items.step(delta, self._logprobs(delta))
        final = deltas[-1][1] if deltas else None
        status = _status(final)
        items.finish(_item_status(status))
        return self.response(status, items, final)

    def _logprobs(self, delta: OutputDelta) -> list[dict[str, Any]]:
        """The logprobs entries of the delta's tokens whose text a message may hold (none when
        the request asks for none)."""
        if not self._wants_logprobs or not delta.token_ids:
            return []
        scored = padded(delta.logprobs, len(delta.token_ids))
        entries: list[dict[str, Any]] = chat_logprobs(
            self._texts, self.prompt, delta.token_ids, scored
        )["content"]
        return entries

    # ---- events -----------------------------------------------------------------------------

    def _event(self, event_type: str, **fields: Any) -> str:
        """One server-sent event, numbered."""
        data = {"type": event_type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event_type}\ndata: {payload}\n\n"

    def _events(self, events: list[Event]) -> list[str]:
        return [self._event(event.type, **event.fields) for event in events]

    async def events(
        self,
        first: tuple[int, OutputDelta] | None,
        deltas: AsyncGenerator[tuple[int, OutputDelta], None],
    ) -> AsyncGenerator[str, None]:
        """The events of a stream whose first delta was already received (`first` None: of
        a stream none of whose deltas was read yet)."""
        in_progress = self.response(ResponseStatus.IN_PROGRESS)
        yield self._event("response.created", response=in_progress)
        yield self._event("response.in_progress", response=in_progress)
        items = OutputItems(self.prompt.request_id)
        final: OutputDelta | None = None
        try:
            if first is not None:
                final = first[1]
                for event in self._events(items.step(final, self._logprobs(final))):
                    yield event
            async for _, delta in deltas:
                for event in self._events(items.step(delta, self._logprobs(delta))):
                    yield event
                final = delta
        except PdserveError as error:
            # NOTE: the headers are sent already; the failure is reported in-band.
            code = error.reason.name.lower()
            message = error.message or error.reason.name
            yield self._event("error", code=code, message=message, param=None)
            failed = self.response(ResponseStatus.FAILED, items, error=error)
            yield self._event("response.failed", response=failed)
            return
        finally:
            await deltas.aclose()
        status = _status(final)
        for event in self._events(items.finish(_item_status(status))):
            yield event
        yield self._event(f"response.{status}", response=self.response(status, items, final))


def response_id(request_id: str) -> str:
    """The id of the response to request `request_id`."""
    return f"{RESPONSE_ID_PREFIX}{request_id}"


def request_id_of(response_id: str) -> str | None:
    """The request id inside a response id; None for an id pdserve never gives."""
    if not response_id.startswith(RESPONSE_ID_PREFIX) or len(response_id) > 200:
        return None
    return response_id.removeprefix(RESPONSE_ID_PREFIX) or None


def _status(final: OutputDelta | None) -> ResponseStatus:
    """``incomplete`` for a completion that ran out of tokens, else ``completed`` (also after
    tool calls)."""
    if final is not None and final.finish_reason is FinishReason.LENGTH:
        return ResponseStatus.INCOMPLETE
    return ResponseStatus.COMPLETED


def _item_status(status: ResponseStatus) -> str:
    """The status of the last output item in a response of `status`."""
    if status in (ResponseStatus.INCOMPLETE, ResponseStatus.FAILED):
        return "incomplete"
    return status.value


def _error(error: PdserveError) -> dict[str, str]:
    return {"code": error.reason.name.lower(), "message": error.message or error.reason.name}
