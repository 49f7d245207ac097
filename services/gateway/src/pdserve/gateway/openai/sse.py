"""Server-sent events: one event's text, and the response that sends a stream of them and gives
back the request's admission when it ends, even on client disconnect."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.gateway.access.admission import Admission

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
