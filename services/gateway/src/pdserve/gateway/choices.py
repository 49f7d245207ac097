"""Several completions of one request (``n``, a list of prompts) as one stream of indexed
deltas: each choice runs as its own request, and `merged` interleaves their deltas in the
order they come, each tagged with its choice index.

The first choice of each prompt starts alone; that prompt's other choices start once it has
its first token. By then its prompt's full blocks are in its prefill's prefix cache, and
cache-aware routing sends the other choices there, so the prompt is computed once rather than
n times. The choices of a prompt share a key (`PreparedRequest.choices`): the router sends
them to the first one's decode where it can, and that decode holds the prompt's full KV
blocks once for all of them, so only each choice's partial last block travels again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence

from pdserve.gateway.request import OutputDelta

_DONE = None


def merged(
    streams: Sequence[AsyncGenerator[tuple[int, OutputDelta], None]], n: int = 1
) -> AsyncGenerator[tuple[int, OutputDelta], None]:
    """Interleaves the choices' deltas as they arrive, each ``(choice index, delta)`` as its
    stream tagged it.

    Args:
        streams: One per choice, `n` consecutive ones per prompt.
        n: Choices per prompt: choice ``i`` starts when choice ``i - i % n`` has delivered
            its first delta (or ended).

    A single stream is returned as it is: a plain request's deltas pass through no layer here.
    The first error of any choice ends the merged stream with that error; closing it (or an
    error) closes every choice's stream, so each one gives back what it holds.
    """
    if len(streams) == 1:
        return streams[0]
    return _interleaved(streams, n)


async def _interleaved(
    streams: Sequence[AsyncGenerator[tuple[int, OutputDelta], None]], n: int
) -> AsyncGenerator[tuple[int, OutputDelta], None]:
    queue: asyncio.Queue[tuple[int, OutputDelta | Exception | None]] = asyncio.Queue()

    has_output = [asyncio.Event() for _ in streams]  # a first delta, or the end

    async def pump(index: int, stream: AsyncGenerator[tuple[int, OutputDelta], None]) -> None:
        try:
            if index % n:
                await has_output[index - index % n].wait()
            async with contextlib.aclosing(stream):
                async for _, delta in stream:
                    queue.put_nowait((index, delta))
                    has_output[index].set()
            queue.put_nowait((index, _DONE))
        except Exception as error:  # handed to the consumer, which raises it
            queue.put_nowait((index, error))
        finally:
            has_output[index].set()

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
