"""The Responses API's output: one ``Response`` object, or its stream of typed events.

A response holds one output item, an assistant ``message`` (id ``msg_<request id>``) with one
``output_text`` part. It is ``completed``, or ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the completion ran out of tokens. A stream sends, as server-sent
events ``event: <type>`` / ``data: <json>`` with a ``sequence_number`` counted from 0:

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta (one per piece of new text),
    response.output_text.done, response.content_part.done, response.output_item.done,
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
from pdserve.gateway.openai.responses_api.convert import ResponsesBody
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import OutputDelta

OUTPUT_INDEX = 0  # the message is the one output item
CONTENT_INDEX = 0  # its text is the one content part


class ResponseWriter:
    """Shapes one request's deltas as a ``Response`` object or its events.

    Args:
        prompt: The prepared request.
        body: The parsed body (model name, the settings the response repeats).
        now: Wall clock for ``created_at`` and ``completed_at``.
    """

    def __init__(
        self, prompt: PreparedRequest, body: ResponsesBody, now: Callable[[], float] = time.time
    ) -> None:
        self.prompt = prompt
        self.choices = [prompt]
        self.n = 1
        self.response_id = f"resp_{prompt.request_id}"
        self.item_id = f"msg_{prompt.request_id}"
        self._body = body
        self._now = now
        self._created_at = int(now())
        self._sequence_number = 0

    # ---- objects ----------------------------------------------------------------------------

    def response(
        self,
        status: str,
        text: str | None = None,
        final: OutputDelta | None = None,
        error: PdserveError | None = None,
    ) -> dict[str, Any]:
        """The ``Response`` object: `text` None has no output yet; `final` (the last delta)
        gives the usage, `error` the failure."""
        sampling = self.prompt.request.sampling
        is_done = status != "in_progress"
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "response",
            "created_at": self._created_at,
            "completed_at": int(self._now()) if is_done and error is None else None,
            "status": status,
            "background": False,
            "error": None if error is None else _error(error),
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "model": self._body.model,
            "output": [] if text is None else [self.message(text, _item_status(status))],
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": False,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "usage": None if final is None else self._usage(final),
            **self._body.echoed,
        }
        return body

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The output message item."""
        content = [] if status == "in_progress" else [_output_text(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

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
        text = "".join(delta.text for _, delta in deltas)
        final = deltas[-1][1] if deltas else None
        return self.response(_status(final), text, final)

    # ---- events -----------------------------------------------------------------------------

    def _event(self, event_type: str, **fields: Any) -> str:
        """One server-sent event, numbered."""
        data = {"type": event_type, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return f"event: {event_type}\ndata: {payload}\n\n"

    def _text_event(self, event_type: str, **fields: Any) -> str:
        return self._event(
            event_type,
            item_id=self.item_id,
            output_index=OUTPUT_INDEX,
            content_index=CONTENT_INDEX,
            **fields,
        )

    async def events(
        self,
        first: tuple[int, OutputDelta],
        deltas: AsyncGenerator[tuple[int, OutputDelta], None],
    ) -> AsyncGenerator[str, None]:
        """The events of a stream whose first delta was already received."""
        in_progress = self.response("in_progress")
        yield self._event("response.created", response=in_progress)
        yield self._event("response.in_progress", response=in_progress)
        item = self.message("", "in_progress")
        yield self._event("response.output_item.added", output_index=OUTPUT_INDEX, item=item)
        yield self._text_event("response.content_part.added", part=_output_text(""))
        pieces: list[str] = []
        final: OutputDelta | None = None
        try:
            async for _, delta in _prepend(first, deltas):
                if delta.text:
                    pieces.append(delta.text)
                    yield self._text_event(
                        "response.output_text.delta", delta=delta.text, logprobs=[]
                    )
                final = delta
        except PdserveError as error:
            # NOTE: the headers are sent already; the failure is reported in-band.
            code = error.reason.name.lower()
            message = error.message or error.reason.name
            yield self._event("error", code=code, message=message, param=None)
            failed = self.response("failed", "".join(pieces), error=error)
            yield self._event("response.failed", response=failed)
            return
        finally:
            await deltas.aclose()
        text = "".join(pieces)
        status = _status(final)
        yield self._text_event("response.output_text.done", text=text, logprobs=[])
        yield self._text_event("response.content_part.done", part=_output_text(text))
        item = self.message(text, _item_status(status))
        yield self._event("response.output_item.done", output_index=OUTPUT_INDEX, item=item)
        yield self._event(f"response.{status}", response=self.response(status, text, final))


async def _prepend(
    first: tuple[int, OutputDelta], rest: AsyncGenerator[tuple[int, OutputDelta], None]
) -> AsyncGenerator[tuple[int, OutputDelta], None]:
    yield first
    async for item in rest:
        yield item


def _status(final: OutputDelta | None) -> str:
    """``incomplete`` for a completion that ran out of tokens, else ``completed``."""
    if final is not None and final.finish_reason is FinishReason.LENGTH:
        return "incomplete"
    return "completed"


def _item_status(status: str) -> str:
    """The message item's status in a response of `status`."""
    return "incomplete" if status in ("incomplete", "failed") else status


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _error(error: PdserveError) -> dict[str, str]:
    return {"code": error.reason.name.lower(), "message": error.message or error.reason.name}
