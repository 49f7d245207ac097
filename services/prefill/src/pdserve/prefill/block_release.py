"""Frees a prefill request's blocks on the engine thread and waits for it on the event loop."""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from pdserve.prefill.prefill_loop import PrefillLoop
from pdserve.prefill.request import Request

log = structlog.get_logger(__name__)


async def free_blocks(loop: PrefillLoop, request: Request, wait_s: float) -> None:
    """Asks the engine thread to release `request`'s blocks and waits up to `wait_s` for it
    (a release that takes longer is logged, not raised: the caller is cleaning up)."""
    aio_loop = asyncio.get_running_loop()
    released = aio_loop.create_future()

    def on_released() -> None:
        with contextlib.suppress(RuntimeError):
            aio_loop.call_soon_threadsafe(_resolve, released)

    loop.release(request, on_released)
    try:
        await asyncio.wait_for(released, wait_s)
    except TimeoutError:
        log.error("prefill_blocks_not_released", request_id=request.request_id)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
