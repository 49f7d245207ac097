"""The life of each prefill request on the event loop: prepare, prefill, ship, hand off.

One asyncio task per request walks QUEUED -> PREPARING -> PREFILLING -> TRANSFERRING ->
HANDED_OFF (or FINISHED when the first token already ends the request) and writes what the
caller must see into the request's outbox. Every way out of that task (success, a typed
failure, `abort`, the caller hanging up) runs the same cleanup: the SyncCache stream is
cancelled if still open, the prefill's blocks are freed on the engine thread, and a decode
lease that was not handed off is released. Errors reach the caller only after that cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
import time

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.prefill.decode_client import DecodePeers
from pdserve.prefill.kv_sender import KvSender
from pdserve.prefill.metrics import PrefillMetrics
from pdserve.prefill.prefill_loop import PrefillLoop
from pdserve.prefill.request import (
    LeaseGrant,
    Request,
    RequestStatus,
    first_token_finish,
    is_length_capped,
)
from pdserve.prefill.request_task import FinishedOut, FirstTokenOut, HandedOffOut, RequestTask

log = structlog.get_logger(__name__)
_tracer = telemetry.tracer("pdserve.prefill")


class Handoffs:
    """Starts, tracks and aborts the requests of one prefill instance on their way to a
    handoff.

    Args:
        loop: The engine thread.
        peers: Channels to the decodes.
        eos_token_ids: The model's end-of-sequence ids.
        max_model_len: Longest sequence served.
        max_queue_len: Most requests in flight; more are refused with PREFILL_OVERLOADED.
        fault_corrupt_kv: Request-id pattern whose first KV chunk is corrupted on purpose
            (fault injection for chaos tests), or None.
    """

    def __init__(
        self,
        loop: PrefillLoop,
        peers: DecodePeers,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        max_queue_len: int,
        fault_corrupt_kv: str | None = None,
    ) -> None:
        self.loop = loop
        self.peers = peers
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.fault_corrupt_kv = fault_corrupt_kv
        self.is_draining = False
        self.live: dict[str, RequestTask] = {}
        self.metrics: PrefillMetrics | None = None
        self.num_kv_bytes_sent = 0
        self._background: set[asyncio.Future[bool]] = set()
        self.num_handed_off = 0

    def start(self, request: Request) -> RequestTask:
        """Admits a validated request and starts its task.

        Raises:
            PdserveError: INSTANCE_DRAINING, PREFILL_OVERLOADED, or INVALID_REQUEST for a
                request id that is already in flight here.
        """
        meta = {"requestId": request.request_id}
        if self.is_draining:
            raise PdserveError(ErrorReason.INSTANCE_DRAINING, "prefill is draining", meta)
        if request.request_id in self.live:
            raise PdserveError(
                ErrorReason.INVALID_REQUEST, "a request with this id is in flight", meta
            )
        if len(self.live) >= self.max_queue_len:
            raise PdserveError(
                ErrorReason.PREFILL_OVERLOADED,
                f"{len(self.live)} requests in flight (max_queue_len {self.max_queue_len})",
                meta,
            )
        request.is_sending_kv = not is_length_capped(request, self.max_model_len)
        task = RequestTask(request)
        request.sink = task.engine_sink()
        self.live[request.request_id] = task
        task.task = asyncio.create_task(self._run(task), name=f"prefill-{request.request_id}")
        log.info(
            "prefill_queued",
            request_id=request.request_id,
            num_tokens=request.num_tokens,
            decode_address=request.decode_address,
        )
        return task

    def cancel(self, task: RequestTask) -> None:
        """Aborts a request whose caller went away (cleanup continues in the background)."""
        if task.task is not None and not task.task.done():
            task.task.cancel()

    async def abort(self, request_id: str) -> bool:
        """Aborts a request at any stage and waits until its lease and blocks are released.

        Returns:
            True if the request was in flight.
        """
        task = self.live.get(request_id)
        if task is None:
            return False
        self.cancel(task)
        await self._wait_done(task)
        return True

    async def abort_all(self) -> None:
        """Aborts every request in flight and waits for their cleanup."""
        tasks = list(self.live.values())
        for task in tasks:
            self.cancel(task)
        for task in tasks:
            await self._wait_done(task)

    async def _wait_done(self, task: RequestTask) -> None:
        assert task.task is not None
        await asyncio.wait([task.task])
        if task.cleanup_task is not None:
            await asyncio.wait([task.cleanup_task])

    # ---- one request -----------------------------------------------------------------------

    async def _run(self, task: RequestTask) -> None:
        request = task.request
        error: PdserveError | None = None
        try:
            await self._prefill(task)
        except asyncio.CancelledError:
            request.status = RequestStatus.ABORTED
            error = PdserveError(
                ErrorReason.CANCELLED, "request aborted", {"requestId": request.request_id}
            )
        except PdserveError as failure:
            request.status = RequestStatus.FAILED
            error = failure
        except Exception as failure:
            log.exception("prefill_internal_error", request_id=request.request_id)
            request.status = RequestStatus.FAILED
            error = PdserveError(ErrorReason.INTERNAL, str(failure))
        finally:
            # NOTE: shielded so that a second cancellation cannot cut the cleanup short.
            task.cleanup_task = asyncio.create_task(self._cleanup(task, error))
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(task.cleanup_task)

    async def _prefill(self, task: RequestTask) -> None:
        request = task.request
        if request.is_sending_kv:
            request.status = RequestStatus.PREPARING
            with _tracer.start_as_current_span(
                "prefill.allocate",
                attributes={
                    telemetry.REQUEST_ID: request.request_id,
                    "pdserve.decode.address": request.decode_address,
                },
            ) as allocate_span:
                allocation = asyncio.ensure_future(self.peers.allocate(request))
                try:
                    lease = await asyncio.shield(allocation)
                except asyncio.CancelledError:
                    # NOTE: the decode may still grant the lease after this request was
                    # aborted: release it then instead of leaving it to the lease TTL.
                    allocation.add_done_callback(
                        functools.partial(self._release_late_grant, request)
                    )
                    raise
                allocate_span.set_attribute("pdserve.lease_id", lease.lease_id)
                allocate_span.set_attribute("pdserve.num_blocks", len(lease.block_ids))
            request.lease = lease
            task.is_lease_open = True
            log.info(
                "lease_granted",
                request_id=request.request_id,
                lease_id=lease.lease_id,
                decode_instance_id=lease.decode_instance_id,
            )
            if (
                request.decode_instance_id
                and lease.decode_instance_id != request.decode_instance_id
            ):
                log.warning(
                    "decode_instance_mismatch",
                    request_id=request.request_id,
                    expected=request.decode_instance_id,
                    actual=lease.decode_instance_id,
                )
            corrupt = self.fault_corrupt_kv is not None and fnmatch.fnmatchcase(
                request.request_id, self.fault_corrupt_kv
            )
            task.sender = KvSender(
                self.peers.stub(request.decode_address), request, corrupt_first_chunk=corrupt
            )
            transfer_span = _tracer.start_span(
                "prefill.kv_transfer",
                attributes={
                    telemetry.REQUEST_ID: request.request_id,
                    "pdserve.transport": "grpc-sync-cache",
                },
            )
            # NOTE: the task copies the current context: its SyncCache call joins the span.
            with telemetry.activated(transfer_span):
                task.sender_task = asyncio.create_task(task.sender.run())
            task.sender_task.add_done_callback(
                functools.partial(
                    self._on_transfer_done, transfer_span, task.sender, time.perf_counter()
                )
            )
        request.status = RequestStatus.PREFILLING
        task.is_submitted = True
        with _tracer.start_as_current_span(
            "prefill.compute",
            attributes={
                telemetry.REQUEST_ID: request.request_id,
                "pdserve.num_tokens": request.num_tokens,
            },
        ):
            if telemetry.is_enabled():
                request.trace_context = otel_context.get_current()
            self.loop.submit(request)
            token_id = await task.wait_first_token()
        index = request.first_token_index
        task.outbox.put_nowait(FirstTokenOut(token_id, index))
        log.info("first_token", request_id=request.request_id, token_id=token_id, index=index)
        finish = first_token_finish(request, token_id, self.eos_token_ids, self.max_model_len)
        if finish is not None:
            await task.release_lease(self.peers)
            request.status = RequestStatus.FINISHED
            task.outbox.put_nowait(FinishedOut(finish, request.num_prompt_tokens, index + 1))
            return
        assert task.sender is not None and task.sender_task is not None
        assert request.lease is not None
        request.status = RequestStatus.TRANSFERRING
        task.sender.commit(token_id, index)
        await task.sender_task
        task.is_lease_open = False  # the decode owns it now
        request.status = RequestStatus.HANDED_OFF
        task.outbox.put_nowait(
            HandedOffOut(request.lease, task.sender.num_chunks, task.sender.num_bytes)
        )
        log.info(
            "handed_off",
            request_id=request.request_id,
            lease_id=request.lease.lease_id,
            num_chunks=task.sender.num_chunks,
            num_bytes=task.sender.num_bytes,
        )

    def _on_transfer_done(
        self, span: trace.Span, sender: KvSender, started: float, done: asyncio.Task[object]
    ) -> None:
        span.set_attribute("pdserve.kv.num_bytes", sender.num_bytes)
        span.set_attribute("pdserve.kv.num_chunks", sender.num_chunks)
        if done.cancelled() or done.exception() is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, "transfer failed"))
        else:
            self.num_kv_bytes_sent += sender.num_bytes
            self.num_handed_off += 1
            if self.metrics is not None:
                self.metrics.transfer_seconds.observe(time.perf_counter() - started)
        span.end()

    def _release_late_grant(self, request: Request, allocation: asyncio.Future[LeaseGrant]) -> None:
        if allocation.cancelled() or allocation.exception() is not None:
            return
        lease = allocation.result()
        log.info("late_lease_released", request_id=request.request_id, lease_id=lease.lease_id)
        release = asyncio.ensure_future(
            self.peers.release_lease(request.decode_address, lease.lease_id, request.request_id)
        )
        self._background.add(release)
        release.add_done_callback(self._background.discard)

    async def _cleanup(self, task: RequestTask, error: PdserveError | None) -> None:
        request = task.request
        try:
            await task.release(self.peers, self.loop)
        finally:
            self.live.pop(request.request_id, None)
            if error is not None:
                log.info(
                    "prefill_failed"
                    if request.status is RequestStatus.FAILED
                    else "prefill_aborted",
                    request_id=request.request_id,
                    reason=error.reason.name,
                    detail=error.message,
                )
                task.outbox.put_nowait(error)
