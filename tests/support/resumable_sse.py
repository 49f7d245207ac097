"""Reading a resumable chat stream's server-sent events: each with its ``id`` (completion
tokens sent so far) and its data."""

from __future__ import annotations

import json
from typing import Any

import httpx

SseEvent = tuple[int, Any]
"""(id, data): the data a chunk's JSON, or the string ``[DONE]``."""


def sse_events(text: str) -> list[SseEvent]:
    """The events of a stream's text (an event before any ``id:`` line gets -1)."""
    events: list[SseEvent] = []
    event_id = -1
    for line in text.splitlines():
        if line.startswith("id: "):
            event_id = int(line.removeprefix("id: "))
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append((event_id, data if data == "[DONE]" else json.loads(data)))
    return events


def chat_content(events: list[SseEvent]) -> str:
    """The assistant text the chat chunks among `events` hold."""
    return "".join(
        data["choices"][0]["delta"].get("content") or ""
        for _, data in events
        if isinstance(data, dict) and data.get("choices")
    )


async def left_after(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], num_events: int = 6
) -> tuple[str, list[SseEvent]]:
    """Posts `body` to `url` as a stream and goes away once `num_events` events came; returns
    the stream's request id and those events."""
    lines: list[str] = []
    async with http.stream("POST", url, json=body) as got:
        assert got.status_code == 200
        stream_id = got.headers["x-request-id"]
        async for line in got.aiter_lines():
            lines.append(line)
            if len(sse_events("\n".join(lines))) >= num_events:
                break  # NOTE: the client goes away mid-stream
    return stream_id, sse_events("\n".join(lines))
