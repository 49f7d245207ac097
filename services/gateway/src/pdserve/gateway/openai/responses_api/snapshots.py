"""What a background response looks like from its deltas: the response object as it stands
(`response_snapshot`), and its events after a client's ``starting_after`` (`events_after`:
the Responses API's own numbering, by sequence number)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from pdserve.common.errors import PdserveError
from pdserve.gateway.openai.responses_api.convert import ResponsesBody
from pdserve.gateway.openai.responses_api.items import OutputItems
from pdserve.gateway.openai.responses_api.writer import ResponseWriter
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import OutputDelta, ResponseStatus
from pdserve.gateway.session.run import RunMoved
from pdserve.gateway.session.store import ResumeRecord


def writer_of(prompt: PreparedRequest, body: ResponsesBody, record: ResumeRecord) -> ResponseWriter:
    completed_at = record.end.completed_at if record.end is not None else None
    return ResponseWriter(prompt, body, created_at=record.created_at, completed_at=completed_at)


async def events_after(
    events: AsyncGenerator[str, None], starting_after: int | None
) -> AsyncGenerator[str, None]:
    """`events` (numbered from 0) after `starting_after`: past the end, the last one (the
    response's end); ends quietly where the run moved to another gateway (the client resumes
    there)."""
    first = 0 if starting_after is None else starting_after + 1
    index = 0
    last: str | None = None
    try:
        async for event in events:
            if index >= first:
                yield event
            last = event
            index += 1
    except RunMoved:
        return
    finally:
        await events.aclose()
    if index <= first and last is not None:
        yield last


def response_snapshot(
    writer: ResponseWriter,
    deltas: list[OutputDelta],
    status: ResponseStatus,
    error: PdserveError | None,
) -> dict[str, Any]:
    """The response object of `deltas` in `status`."""
    if status in (ResponseStatus.COMPLETED, ResponseStatus.INCOMPLETE) and deltas:
        return writer.full([(0, delta) for delta in deltas])
    items = OutputItems(writer.prompt.request_id)
    for delta in deltas:
        items.step(delta)
    if status == ResponseStatus.IN_PROGRESS:
        return writer.response(status, items if deltas else None, with_text=True)
    items.finish("incomplete")
    shown = error if status == ResponseStatus.FAILED else None
    return writer.response(status, items, error=shown)
