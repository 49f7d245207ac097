"""The life of each prefill request on the event loop: prepare, prefill, ship, hand off.

One asyncio task per request walks it QUEUED -> PREPARING -> PREFILLING -> TRANSFERRING ->
HANDED_OFF (or FINISHED when the first token already ends the request) through its own
transitions (`Request.move_to`/`end`) and writes what the caller must see into its outbox;
its decode lease comes from `leasing.open_lease`. Whether it ships KV at all and whether its
first token ends it is the one stop rule (`is_length_capped`, `first_token_finish`).
Every way out of that task (success, a typed failure, `abort`, the caller hanging up) runs
the same cleanup (`Request.release`): the SyncCache stream is
cancelled if still open, the prefill's blocks are freed on the engine thread, and a decode
lease that was not handed off is released. Errors reach the caller only after that cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import functools
import time
from collections.abc import Sequence

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason, check_stop, is_length_reached
from pdserve.prefill.decode_client import DecodePeers
from pdserve.prefill.events import FinishedOut, FirstTokenOut, HandedOffOut
from pdserve.prefill.kv_channels import SharedPools
from pdserve.prefill.kv_sender import KvSender
from pdserve.prefill.kv_transports import channels_for
from pdserve.prefill.leasing import open_lease
from pdserve.prefill.metrics import PrefillMetrics
from pdserve.prefill.prefill_loop import PrefillLoop
from pdserve.prefill.request import Request, RequestStatus

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
        kv_transports: The KV transports this prefill may use, in order of preference.
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
        kv_transports: Sequence[str] = ("grpc",),
        fault_corrupt_kv: str | None = None,
    ) -> None:
        self.loop = loop
        self.peers = peers
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.fault_corrupt_kv = fault_corrupt_kv
        self.kv_transports = tuple(kv_transports)
        self.shared_pools = SharedPools(loop.runner.kv_cache.layout)
        self.is_draining = False
        self.live: dict[str, Request] = {}
        self.metrics: PrefillMetrics | None = None
        self.num_kv_bytes_sent = 0
        self._background: set[asyncio.Future[bool]] = set()
        self.num_handed_off = 0

    def start(self, request: Request) -> Request:
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
        request.sink = request.engine_sink()
        self.live[request.request_id] = request
        request.task = asyncio.create_task(self._run(request), name=f"prefill-{request.request_id}")
        log.info(
            "prefill_queued",
            request_id=request.request_id,
            num_tokens=request.num_tokens,
            decode_address=request.decode_address,
        )
        return request

    def cancel(self, request: Request) -> None:
        """Aborts a request whose caller went away (cleanup continues in the background)."""
        if request.task is not None and not request.task.done():
            request.task.cancel()

    async def abort(self, request_id: str) -> bool:
        """Aborts a request at any stage and waits until its lease and blocks are released.

        Returns:
            True if the request was in flight.
        """
        request = self.live.get(request_id)
        if request is None:
            return False
        self.cancel(request)
        await self._wait_done(request)
        return True

    async def abort_all(self) -> None:
        """Aborts every request in flight and waits for their cleanup."""
        requests = list(self.live.values())
        for request in requests:
            self.cancel(request)
        for request in requests:
            await self._wait_done(request)

    async def _wait_done(self, request: Request) -> None:
        assert request.task is not None
        await asyncio.wait([request.task])
        if request.cleanup_task is not None:
            await asyncio.wait([request.cleanup_task])

    # ---- one request -----------------------------------------------------------------------

    async def _run(self, request: Request) -> None:
        error: PdserveError | None = None
        try:
            await self._prefill(request)
        except asyncio.CancelledError:
            request.end(RequestStatus.ABORTED)
            error = PdserveError(
                ErrorReason.CANCELLED, "request aborted", {"requestId": request.request_id}
            )
        except PdserveError as failure:
            request.end(RequestStatus.FAILED)
            error = failure
        except Exception as failure:
            log.exception("prefill_internal_error", request_id=request.request_id)
            request.end(RequestStatus.FAILED)
            error = PdserveError(ErrorReason.INTERNAL, str(failure))
        finally:
            # NOTE: shielded so that a second cancellation cannot cut the cleanup short.
            request.cleanup_task = asyncio.create_task(self._cleanup(request, error))
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(request.cleanup_task)

    async def _prefill(self, request: Request) -> None:
        if request.is_sending_kv:
            request.move_to(RequestStatus.PREPARING)
            await open_lease(self.peers, request, self._background)
            corrupt = self.fault_corrupt_kv is not None and fnmatch.fnmatchcase(
                request.request_id, self.fault_corrupt_kv
            )
            stub = self.peers.stub(request.decode_address, request.decode_instance_id)
            request.sender = KvSender(
                request,
                channels_for(request, stub, self.shared_pools, self.kv_transports),
                corrupt_first_chunk=corrupt,
            )
            transfer_span = _tracer.start_span(
                "prefill.kv_transfer", attributes={telemetry.REQUEST_ID: request.request_id}
            )
            # NOTE: the task copies the current context: its SyncCache call joins the span.
            with telemetry.activated(transfer_span):
                request.sender_task = asyncio.create_task(request.sender.run())
            request.sender_task.add_done_callback(
                functools.partial(
                    self._on_transfer_done, transfer_span, request.sender, time.perf_counter()
                )
            )
        if self.loop.store_loader is not None:
            # NOTE: store I/O on a worker thread, before the engine thread sees the request.
            await self.loop.store_loader.load(request)
        request.move_to(RequestStatus.PREFILLING)
        request.is_submitted = True
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
            token_id = await request.wait_first_token()
        index = request.first_token_index
        request.outbox.put_nowait(FirstTokenOut(token_id, index))
        log.info(
            "first_token",
            request_id=request.request_id,
            token_id=token_id,
            index=index,
            num_cached_tokens=request.num_cached_tokens,
            num_loaded_tokens=request.num_loaded_tokens,
        )
        finish = first_token_finish(request, token_id, self.eos_token_ids, self.max_model_len)
        if finish is not None:
            await request.release_lease(self.peers)
            request.move_to(RequestStatus.FINISHED)
            request.outbox.put_nowait(FinishedOut(finish, request.num_prompt_tokens, index + 1))
            return
        sender = request.sender
        assert sender is not None and request.sender_task is not None
        assert request.lease is not None
        request.move_to(RequestStatus.TRANSFERRING)
        sender.commit(token_id, index)
        await request.sender_task
        request.is_lease_open = False  # the decode owns it now
        request.move_to(RequestStatus.HANDED_OFF)
        request.outbox.put_nowait(
            HandedOffOut(request.lease, sender.num_chunks, sender.num_bytes, sender.transport)
        )
        log.info(
            "handed_off",
            request_id=request.request_id,
            lease_id=request.lease.lease_id,
            num_chunks=sender.num_chunks,
            num_bytes=sender.num_bytes,
            transport=sender.transport,
        )

    def _on_transfer_done(
        self, span: trace.Span, sender: KvSender, started: float, done: asyncio.Task[object]
    ) -> None:
        span.set_attribute("pdserve.transport", sender.transport)
        span.set_attribute("pdserve.kv.num_bytes", sender.num_bytes)
        span.set_attribute("pdserve.kv.num_chunks", sender.num_chunks)
        if done.cancelled() or done.exception() is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, "transfer failed"))
        else:
            self.num_kv_bytes_sent += sender.num_bytes
            self.num_handed_off += 1
            if self.metrics is not None:
                seconds = time.perf_counter() - started
                self.metrics.transfer_seconds.labels(sender.transport).observe(seconds)
        span.end()

    async def _cleanup(self, request: Request, error: PdserveError | None) -> None:
        try:
            await request.release(self.peers, self.loop)
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
                request.outbox.put_nowait(error)


def is_length_capped(request: Request, max_model_len: int) -> bool:
    """Whether the first token ends the request whatever it is (max_tokens or model length)."""
    return is_length_reached(
        request.first_token_index + 1, request.sampling, request.num_tokens + 1, max_model_len
    )


def first_token_finish(
    request: Request, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> FinishReason | None:
    """Why the first token ends the request, or None when the decode continues it (the one
    stop rule, `check_stop`, at the first token's completion index)."""
    return check_stop(
        token_id,
        request.first_token_index + 1,
        request.sampling,
        eos_token_ids,
        num_tokens=request.num_tokens + 1,
        max_model_len=max_model_len,
    )
