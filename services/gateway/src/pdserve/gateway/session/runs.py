"""The resumable requests this gateway holds, each running in a task of its own.

Each is a `pdserve.gateway.session.run.Run`, driven through the streamer here. The run writes the
request's record at its start, when a decode takes it and at its end
(`pdserve.gateway.session.store`), so another gateway can take it over where this one died. A
run that another gateway took over (the decode says so) ends here without a word in the store:
the other gateway writes it from now on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import structlog

from pdserve.common.errors import ErrorReason, PdserveError, is_taken_over
from pdserve.common.generation import FinishReason
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import ApiKind, OutputDelta, Placement, ResponseStatus, Resumable
from pdserve.gateway.session.run import Run
from pdserve.gateway.session.store import ResumeRecord, ResumeStore, StoredEnd
from pdserve.gateway.streaming import Streamer

log = structlog.get_logger("pdserve.gateway.session")

T = TypeVar("T")


class Runs:
    """Starts, finds and cancels this gateway's resumable requests.

    Args:
        store: Where their records live.
        streamer: Runs requests.
        metrics: Counts the store writes.
        request_timeout_s: Longest a request runs (its record lives that long, plus
            `keep_s`, until it ends).
        keep_s: How long an ended request stays readable.
        now: Wall clock.
    """

    def __init__(
        self,
        store: ResumeStore,
        streamer: Streamer,
        metrics: GatewayMetrics,
        request_timeout_s: float,
        keep_s: float,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self._streamer = streamer
        self.metrics = metrics
        self._running_ttl_s = request_timeout_s + keep_s
        self.keep_s = keep_s
        self._now = now
        self._runs: dict[str, Run] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def get(self, request_id: str) -> Run | None:
        """The run of `request_id` this gateway holds (also for `keep_s` after its end)."""
        return self._runs.get(request_id)

    async def start(
        self, record: ResumeRecord, prepared: PreparedRequest, attach_to: Placement | None = None
    ) -> Run:
        """Writes a new request's record (unless `attach_to`: taking one over) and starts it.

        Raises:
            PdserveError: From the store (full: RATE_LIMITED; unreachable: PEER_UNAVAILABLE).
        """
        if attach_to is None and record.placement is None and record.end is None:
            await self.put(record, self._running_ttl_s)
        run = Run(record, prepared)
        self._runs[record.request_id] = run
        resumable = Resumable(lambda placement: self._placed(run, placement), attach_to)
        run.resumable = resumable
        run.task = asyncio.get_running_loop().create_task(self._drive(run, resumable))
        log.info(
            "resumable_request_started",
            request_id=record.request_id,
            kind=record.kind,
            is_takeover=attach_to is not None or record.placement is not None,
        )
        return run

    async def begin(
        self, kind: ApiKind, body: str, prepared: PreparedRequest, owner: str | None
    ) -> Run:
        """Starts a new resumable request (its record written first).

        Args:
            kind: The API that took it.
            body: The request as the client sent it (text; a gRPC request's bytes in base64).
            prepared: The prepared request (its seed is set).
            owner: Name of the API key that sent it (None on an open gateway).

        Raises:
            PdserveError: From the store (full: RATE_LIMITED; unreachable: PEER_UNAVAILABLE).
        """
        return await self.start(self.record_of(kind, body, prepared, owner), prepared)

    def record_of(
        self, kind: ApiKind, body: str, prepared: PreparedRequest, owner: str | None
    ) -> ResumeRecord:
        """A new request's record, created now (arguments as `begin`)."""
        seed = prepared.request.sampling.seed
        assert seed is not None, "the frontend gives every request a seed"
        return ResumeRecord(prepared.request_id, kind, owner, body, seed, self._now())

    async def keep_end(
        self, record: ResumeRecord, deltas: list[OutputDelta], error: PdserveError | None = None
    ) -> ResumeRecord:
        """Writes the record of a plain request that ended (a stored response), kept
        `keep_s`: one write.

        Args:
            record: Its record (`record_of`).
            deltas: Its deltas (the last one final, unless it failed).
            error: How it failed; None: it finished.

        Returns:
            The record written.

        Raises:
            PdserveError: From the store (RATE_LIMITED, PEER_UNAVAILABLE).
        """
        now = self._now()
        end = (
            finished(deltas, now)
            if error is None
            else failed(ResponseStatus.FAILED, deltas, error, now)
        )
        ended = replace(record, end=end)
        await self.put(ended, self.keep_s)
        return ended

    async def take_over(self, record: ResumeRecord, prompt: PreparedRequest) -> Run:
        """The live run of a request another gateway held: this gateway's own if it has one
        (not moved away), else a new one attached to where the record says it runs."""
        run = self._runs.get(record.request_id)
        if run is not None and not run.is_moved:
            return run
        return await self.start(record, prompt, attach_to=record.placement)

    async def adopt(self, record: ResumeRecord, revision: int) -> bool:
        """Makes this gateway the holder of an orphan (`ResumeStore.orphans`); False when
        another gateway adopted it first or it changed meanwhile."""
        adopted = await self.store.adopt(record, revision, self._running_ttl_s)
        if adopted:
            self.metrics.resume_store_writes.inc()
        return adopted

    async def fail_stored(self, record: ResumeRecord, error: PdserveError) -> None:
        """Ends a stored request this gateway cannot run with `error` (failed)."""
        end = StoredEnd(
            status=ResponseStatus.FAILED,
            completed_at=self._now(),
            error_code=error.reason.name.lower(),
            error_message=error.message or error.reason.name,
        )
        await self.put(replace(record, end=end), self.keep_s)

    async def cancel(self, run: Run) -> None:
        """Cancels a running request (its lease is released) and waits for its end."""
        if run.task is not None and not run.task.done():
            run.task.cancel()
            await asyncio.gather(run.task, return_exceptions=True)

    async def leave(self, hand_over: bool) -> None:
        """Ends every running request here (this gateway stops) and waits for the writes in
        flight.

        Args:
            hand_over: Leave them to the other gateways (a shared store): each decode keeps
                its request for the next gateway that resumes it, and clients following it
                here see their stream end without its end event (they resume elsewhere).
                False (no other gateway can read the store): cancel them.
        """
        running = [run for run in self._runs.values() if not run.is_done]
        for run in running:
            assert run.resumable is not None
            run.resumable.is_left = run.is_moved = hand_over
            await self.cancel(run)
        if running:
            log.info("resumable_requests_left", num_requests=len(running), hand_over=hand_over)
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def track(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """`work` as a task `leave` waits for (a write that may outlast its request)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def put(self, record: ResumeRecord, ttl_s: float) -> None:
        """Writes `record` to the store (counted)."""
        await self.store.put(record, ttl_s)
        self.metrics.resume_store_writes.inc()

    async def _put_unless_ended(self, record: ResumeRecord, ttl_s: float) -> ResumeRecord | None:
        """`ResumeStore.put_unless_ended`, counted when it writes."""
        stored = await self.store.put_unless_ended(record, ttl_s)
        if stored is None:
            self.metrics.resume_store_writes.inc()
        return stored

    def _placed(self, run: Run, placement: Placement) -> None:
        run.record = run.record.with_placement(placement)
        record = run.record

        async def write() -> None:
            stored = await self._put_unless_ended(record, self._running_ttl_s)
            if stored is None:
                return
            # NOTE: cancelled through another gateway (which released the lease it knew of,
            # not this one): stop, and keep that end.
            run.record = stored
            log.info("resumable_request_ended_elsewhere", request_id=run.request_id)
            if run.task is not None and run.task is not asyncio.current_task():
                run.task.cancel()

        self._after_last_write(run, write)

    def _after_last_write(self, run: Run, write: Callable[[], Awaitable[None]]) -> None:
        """Runs `write` once the run's previous write is done, so that its writes land in
        order (an end written before a slower placement would be overwritten)."""
        previous = run.last_write

        async def in_order() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            try:
                await write()
            except PdserveError as error:
                log.warning(
                    "resume_record_not_written", request_id=run.request_id, reason=error.message
                )

        run.last_write = self.track(in_order())

    async def _drive(self, run: Run, resumable: Resumable) -> None:
        end: StoredEnd | None = None
        try:
            deltas = self._streamer.stream(run.prepared, resumable=resumable)
            is_placement_stored = False
            async with contextlib.aclosing(deltas):
                async for _, delta in deltas:
                    if not is_placement_stored and run.last_write is not None:
                        # NOTE: a client sees no token before the record says where the request
                        # runs: a gateway that dies after its first token leaves a record the
                        # next one takes the stream over by, never one it would run again.
                        await asyncio.shield(run.last_write)
                        is_placement_stored = True
                    run.add(delta)
            end = finished(run.deltas, self._now())
        except PdserveError as error:
            if is_taken_over(error):
                run.is_moved = True
                log.info("resumable_request_moved", request_id=run.request_id)
            else:
                run.error = error
                end = failed(ResponseStatus.FAILED, run.deltas, error, self._now())
        except asyncio.CancelledError:
            if not resumable.is_left:
                cancelled = PdserveError(ErrorReason.CANCELLED, "the response was cancelled")
                run.error = cancelled
                end = failed(ResponseStatus.CANCELLED, run.deltas, cancelled, self._now())
            raise
        finally:
            if end is not None:
                run.record = replace(run.record, end=end)
                self._write_end(run)
            run.done()
            asyncio.get_running_loop().call_later(self.keep_s, self.forget, run)

    def _write_end(self, run: Run) -> None:
        """Writes the run's end unless the stored record already ended (cancelled through
        another gateway), whose end the run then takes."""
        record = run.record

        async def write() -> None:
            stored = await self._put_unless_ended(record, self.keep_s)
            if stored is not None:
                run.record = stored

        self._after_last_write(run, write)

    def forget(self, run: Run) -> None:
        """Drops an ended run from this gateway (kept `keep_s` after its end, or deleted)."""
        if self._runs.get(run.request_id) is run:
            del self._runs[run.request_id]


def finished(deltas: list[OutputDelta], now: float) -> StoredEnd:
    """The end of a request that finished with `deltas` (the last one final)."""
    final = deltas[-1] if deltas else None
    reason = final.finish_reason if final is not None else None
    usage = final.usage if final is not None else None
    is_cut = reason is FinishReason.LENGTH
    return StoredEnd(
        status=ResponseStatus.INCOMPLETE if is_cut else ResponseStatus.COMPLETED,
        token_ids=tuple(t for delta in deltas for t in delta.token_ids),
        finish_reason=None if reason is None else reason.value,
        num_cached_prompt_tokens=0 if usage is None else usage.num_cached_prompt_tokens,
        completed_at=now,
    )


def failed(
    status: ResponseStatus, deltas: list[OutputDelta], error: PdserveError, now: float
) -> StoredEnd:
    """The end of a request that failed or was cancelled (`status`) after `deltas`."""
    return StoredEnd(
        status=status,
        token_ids=tuple(t for delta in deltas for t in delta.token_ids),
        completed_at=now,
        error_code=error.reason.name.lower(),
        error_message=error.message or error.reason.name,
    )
