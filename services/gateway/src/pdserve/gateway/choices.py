"""Several completions of one request (``n``, a list of prompts) as one stream of indexed
deltas: each choice runs as its own request, concurrently, and `merged` interleaves their
deltas in the order they come, each tagged with its choice index."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence

from pdserve.gateway.request import OutputDelta

_DONE = None


async def merged(
    streams: Sequence[AsyncGenerator[OutputDelta, None]],
) -> AsyncGenerator[tuple[int, OutputDelta], None]:
    """Interleaves the choices' deltas as they arrive, as ``(choice index, delta)``.

    The first error of any choice ends the merged stream with that error; closing it (or an
    error) closes every choice's stream, so each one gives back what it holds.
    """
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for delta in only:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, OutputDelta | Exception | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[OutputDelta, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    queue.put_nowait((index, delta))
            queue.put_nowait((index, _DONE))
        except Exception as error:  # handed to the consumer, which raises it
            queue.put_nowait((index, error))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item = await queue.get()
            if item is _DONE:
                num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
