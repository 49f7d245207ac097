"""A client of resumable completions streams that outlives its gateway, as a client told
"resume on any gateway" would be written: it follows a stream and, when the connection breaks
(the gateway died) or the stream ends without its ``[DONE]`` (the gateway left it), resumes it
at the same address from the last event it got, once something answers there again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx

RETRY_PAUSE_S = 0.1


class StreamFailed(AssertionError):
    """The gateway answered with an error (a status or an error event): what the client got."""


async def follow_resumable_completion(
    http: httpx.AsyncClient,
    base_url: str,
    body: dict[str, Any],
    *,
    timeout_s: float,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> list[int]:
    """Streams the completion `body` asks for (``/v1/completions``; made resumable and asked
    for its token ids here) and returns its token ids, resuming it through `base_url` across
    broken connections.

    A request whose POST broke before its id came back (no ``X-Request-Id`` yet) is sent
    again: with its seed it gives the same tokens.

    Args:
        http: The HTTP client.
        base_url: The gateway's REST base URL.
        body: The completions body (model, prompt, max_tokens, sampling).
        timeout_s: The whole stream's bound, resumes included (raises TimeoutError).
        on_tokens: Called with the ids so far after every chunk.

    Raises:
        StreamFailed: For an error status or an error event.
    """
    body = {
        **body,
        "stream": True,
        "stream_options": {"resumable": True},
        "return_token_ids": True,
    }
    ids: list[int] = []
    stream_id: str | None = None
    last: int | None = None
    async with asyncio.timeout(timeout_s):
        while True:
            if stream_id is None:
                request = http.stream("POST", f"{base_url}/v1/completions", json=body)
            else:
                params = {} if last is None else {"starting_after": last}
                url = f"{base_url}/v1/completions/cmpl-{stream_id}/stream"
                request = http.stream("GET", url, params=params)
            try:
                async with request as got:
                    if got.status_code != 200:
                        text = (await got.aread()).decode(errors="replace")
                        raise StreamFailed(f"{got.status_code}: {text}")
                    stream_id = stream_id or got.headers["x-request-id"]
                    event_id: int | None = None
                    async for line in got.aiter_lines():
                        if line.startswith("id: "):
                            event_id = int(line.removeprefix("id: "))
                            continue
                        if not line.startswith("data: "):
                            continue
                        data = line.removeprefix("data: ")
                        if data == "[DONE]":
                            return ids
                        chunk = json.loads(data)
                        if "error" in chunk:
                            raise StreamFailed(f"error event: {chunk['error']}")
                        for choice in chunk.get("choices") or ():
                            ids.extend(choice.get("token_ids") or ())
                        last = event_id
                        if on_tokens is not None:
                            on_tokens(ids)
            except httpx.TransportError:
                pass  # NOTE: the gateway went away: resume once it answers again
            await asyncio.sleep(RETRY_PAUSE_S)
