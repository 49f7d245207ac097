"""Workers for the heavy steps of preparing a request, so the event loop stays free.

Parsing a large body, tokenizing a long prompt and rendering a chat template take time
proportional to the input; on the event loop they would stall every other request, the health
endpoints and the registry's heartbeats. Two pools take them, each bounding how long a request
may wait for its step:

* `WorkerPool` (threads) tokenizes and renders chat templates. Threads help because that work
  lets go of the GIL: `pdserve.tokenizer.Tokenizer.encode` goes through ``encode_batch``, which
  releases it, and a chat template is Python bytecode, which yields it every switch interval.
* `ParserPool` (processes) parses request messages larger than `INLINE_PARSE_BYTES`. Parsing
  holds the GIL for the whole call (pydantic's and protobuf's native parsers), so a thread would
  stall the loop just the same; smaller messages parse inline in a few milliseconds at worst.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import multiprocessing
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import ParamSpec, TypeVar

import structlog

from pdserve.common.errors import ErrorReason, PdserveError

log = structlog.get_logger("pdserve.gateway.prepare.workers")

P = ParamSpec("P")
T = TypeVar("T")

# NOTE: the slowest body of this size to parse (a thousand empty chat messages) takes about 6 ms.
INLINE_PARSE_BYTES = 16 * 1024
PRELOADED_MODULES = [
    "pdserve.gateway.openai.parsing",
    "pdserve.gateway.openai.responses_api.convert",
    "pdserve.gateway.grpc_api.parsing",
]


def _deadline_exceeded(budget_s: float) -> PdserveError:
    return PdserveError(
        ErrorReason.DEADLINE_EXCEEDED, f"preparing the request took longer than {budget_s:g} s"
    )


class WorkerPool:
    """A fixed pool of threads with a time budget per call.

    Args:
        num_workers: Threads; at most this many steps run at once, the rest queue.
        budget_s: Seconds one call may take, waiting in the queue included.
    """

    def __init__(self, num_workers: int, budget_s: float) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_workers, thread_name_prefix="gateway-prepare"
        )
        self._budget_s = budget_s

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Runs ``fn(*args, **kwargs)`` on a worker thread and returns its result.

        Raises:
            PdserveError: DEADLINE_EXCEEDED when the budget runs out first (a call still queued
                is dropped; one already running finishes on its thread, its result unused).
            Exception: Whatever `fn` raises.
        """
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wait_for(future, self._budget_s)
        except TimeoutError:
            raise _deadline_exceeded(self._budget_s) from None

    def shutdown(self) -> None:
        """Drops queued calls; running ones finish on their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class ParserPool:
    """Parses large request messages in worker processes.

    The processes start on the first large message (from a fork server that has the parsing
    code imported already, so each starts in milliseconds) and stay for the next ones.

    Args:
        num_processes: Worker processes.
        budget_s: Seconds one parse may take, waiting in the queue included.
    """

    def __init__(self, num_processes: int, budget_s: float) -> None:
        self._num_processes = num_processes
        self._budget_s = budget_s
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None

    def _get_executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._executor is None:
            # NOTE: never fork the gateway itself: its gRPC threads do not survive a fork.
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOADED_MODULES)
            self._executor = concurrent.futures.ProcessPoolExecutor(
                self._num_processes, mp_context=context
            )
        return self._executor

    async def run(self, fn: Callable[P, T], num_bytes: int, *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)``: inline below `INLINE_PARSE_BYTES`, else in a worker process.

        `fn` must be a module-level function whose arguments, result and exceptions pickle.

        Args:
            fn: The parser.
            num_bytes: Size of the message `fn` parses.

        Raises:
            PdserveError: DEADLINE_EXCEEDED when the budget runs out first; INTERNAL when a
                worker process died (the pool is replaced for the next call).
            Exception: Whatever `fn` raises.
        """
        if num_bytes <= INLINE_PARSE_BYTES:
            return fn(*args, **kwargs)
        executor = self._get_executor()
        call = functools.partial(fn, *args, **kwargs)

        async def parse() -> T:
            # NOTE: submit may start a worker process and wait for the fork server's reply
            # (the first time, until it has imported the parsing code): not on the loop.
            future = await asyncio.to_thread(executor.submit, call)
            return await asyncio.wrap_future(future)

        try:
            return await asyncio.wait_for(parse(), self._budget_s)
        except TimeoutError:
            raise _deadline_exceeded(self._budget_s) from None
        except BrokenProcessPool as exc:
            log.error("parser_pool_broken", error=str(exc))
            if self._executor is executor:
                self._executor = None
                executor.shutdown(wait=False, cancel_futures=True)
            raise PdserveError(ErrorReason.INTERNAL, "a parser process failed") from None

    def shutdown(self) -> None:
        """Stops the worker processes (queued parses are dropped)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
