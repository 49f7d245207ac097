"""The life of each prefill request on the event loop: prepare, prefill, ship, hand off.

One asyncio task per request walks it QUEUED -> PREPARING -> PREFILLING -> TRANSFERRING ->
HANDED_OFF (or FINISHED when the first token already ends the request) through its own
transitions (`Request.move_to`/`end`) and writes what the caller must see into the outbox of
its `InFlight`; it waits in QUEUED for its turn in the lease window (`leasing.LeaseWindow`),
and its decode lease comes from `leasing.open_lease`. Whether it ships KV at all
and whether its first token ends it is the one stop rule (`Request.is_length_capped`,
`Request.first_token_finish`). Every way out of that task (success, a typed failure, `abort`,
the caller hanging up) runs the same cleanup (`Handoffs._release`): a decode lease that was
not handed off is released, the SyncCache stream is cancelled if still open, and the
prefill's blocks are freed on the engine thread. Errors reach the caller only after that.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Sequence

import structlog
from opentelemetry import context as otel_context

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.engine.constraints import ConstraintCompiler, ConstraintState
from pdserve.prefill.block_release import free_blocks
from pdserve.prefill.decode_client import DecodePeers
from pdserve.prefill.events import FinishedOut, FirstTokenOut, HandedOffOut
from pdserve.prefill.in_flight import InFlight
from pdserve.prefill.kv.transfers import KvTransfers
from pdserve.prefill.leasing import LeaseWindow, open_lease, release_lease
from pdserve.prefill.metrics import PrefillMetrics
from pdserve.prefill.prefill_loop import PrefillLoop
from pdserve.prefill.request import Request, RequestStatus

log = structlog.get_logger(__name__)
_tracer = telemetry.tracer("pdserve.prefill")

RELEASE_WAIT_S = 30.0
# NOTE: a retry waits this long for its earlier attempt's abort to release the old lease (a
# ReleaseLease to a frozen decode runs into its own deadline first).
ABORT_WAIT_S = 5.0


class Handoffs:
    """Starts, tracks and aborts the requests of one prefill instance on their way to a
    handoff, and gives back what each holds when it ends; its `transfers` start their KV
    transfers.

    Args:
        loop: The engine thread.
        peers: Channels to the decodes.
        eos_token_ids: The model's end-of-sequence ids.
        max_model_len: Longest sequence served.
        max_queue_len: Most requests in flight; more are refused with PREFILL_OVERLOADED.
        kv_transports: The KV transports this prefill may use, in order of preference.
        fault_corrupt_kv: Request-id pattern whose first KV chunk is corrupted on purpose
            (fault injection for chaos tests), or None.
        constraints: Compiles structured-output constraints (None: the model has no
            tokenizer).
        lease_window_tokens: The lease window's bound (`LeaseWindow`); None: none.
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
        constraints: ConstraintCompiler | None = None,
        lease_window_tokens: int | None = None,
    ) -> None:
        self.loop = loop
        self.window = LeaseWindow(lease_window_tokens)
        self.constraints = constraints
        self.peers = peers
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.max_queue_len = max_queue_len
        self.transfers = KvTransfers(
            loop.runner.kv_cache,
            kv_transports,
            fault_corrupt_kv,
            loop.runner.model_config.window_layers,
        )
        self.is_draining = False
        self.is_stopping = False
        self.live: dict[str, InFlight] = {}
        self.metrics: PrefillMetrics | None = None
        self._background: set[asyncio.Future[bool]] = set()

    def start(self, request: Request) -> InFlight:
        """Admits a validated request and starts its task; its outbox is what the caller reads.

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
        request.is_sending_kv = not request.is_length_capped(self.max_model_len)
        flight = InFlight(request)
        request.sink = flight.engine_sink()
        self.live[request.request_id] = flight
        flight.task = asyncio.create_task(self._run(flight), name=f"prefill-{request.request_id}")
        log.info(
            "prefill_queued",
            request_id=request.request_id,
            num_tokens=request.num_tokens,
            decode_address=request.decode_address,
        )
        return flight

    async def admit(self, request: Request) -> InFlight:
        """`start`, once an earlier attempt of the same request id that is being aborted has
        let go of what it held (up to `ABORT_WAIT_S`).

        A gateway retries a request under its id after aborting the attempt before; that
        abort may still be releasing the old lease on a decode that does not answer (frozen,
        partitioned) when the retry arrives here.

        Raises:
            PdserveError: As `start`; PREFILL_OVERLOADED (the gateway waits for room) when
                the earlier attempt is still being released after `ABORT_WAIT_S`.
        """
        previous = self.live.get(request.request_id)
        if previous is not None and previous.is_ending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(ABORT_WAIT_S):
                    await self._wait_done(previous)
            if self.live.get(request.request_id) is previous:
                raise PdserveError(
                    ErrorReason.PREFILL_OVERLOADED,
                    f"the request's previous attempt is still being released here after "
                    f"{ABORT_WAIT_S:g} s",
                    {"requestId": request.request_id},
                )
        return self.start(request)

    def cancel(self, flight: InFlight) -> None:
        """Aborts a request whose caller went away (cleanup continues in the background)."""
        if flight.task is not None and not flight.task.done():
            flight.task.cancel()

    async def abort(self, request_id: str) -> bool:
        """Aborts a request at any stage and waits until its lease and blocks are released.

        Returns:
            True if the request was in flight.
        """
        flight = self.live.get(request_id)
        if flight is None:
            return False
        self.cancel(flight)
        await self._wait_done(flight)
        return True

    async def abort_all(self) -> None:
        """Aborts every request in flight and waits for their cleanup (the instance stops:
        each ends with INSTANCE_DRAINING, which a gateway retries on another instance)."""
        self.is_draining = self.is_stopping = True
        flights = list(self.live.values())
        for flight in flights:
            self.cancel(flight)
        for flight in flights:
            await self._wait_done(flight)

    async def _wait_done(self, flight: InFlight) -> None:
        assert flight.task is not None
        await asyncio.wait([flight.task])
        if flight.cleanup_task is not None:
            await asyncio.wait([flight.cleanup_task])

    # ---- one request -----------------------------------------------------------------------

    async def _run(self, flight: InFlight) -> None:
        request = flight.request
        error: PdserveError | None = None
        try:
            await self._prefill(flight)
        except asyncio.CancelledError:
            request.end(RequestStatus.ABORTED)
            error = PdserveError(
                ErrorReason.CANCELLED, "request aborted", {"requestId": request.request_id}
            )
            if self.is_stopping:
                # NOTE: not the caller's cancel: the instance stops under it (SIGTERM past the
                # drain, a tensor-parallel rank lost), and the request may go on elsewhere.
                error = PdserveError(
                    ErrorReason.INSTANCE_DRAINING,
                    "the prefill instance stopped while computing the prompt",
                    {"requestId": request.request_id},
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
            flight.cleanup_task = asyncio.create_task(self._cleanup(flight, error))
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(flight.cleanup_task)

    async def _prefill(self, flight: InFlight) -> None:
        request = flight.request
        # NOTE: compiled (and the completion replayed) on the compiler's thread while the
        # lease opens; the engine thread only asks the matcher for masks.
        constraint_state = self._prepare_constraint(request)
        if self.loop.store_loader is not None:
            # NOTE: store I/O on a worker thread, before the engine thread sees the request,
            # and before a lease: a store that hangs (cut off, until it is found unreachable)
            # delays the request, but the decode's lease TTL runs only from the grant.
            await self.loop.store_loader.load(request)
        await self._take_turn(flight)
        assert flight.window_place is not None
        if request.is_sending_kv:
            request.move_to(RequestStatus.PREPARING)
            lease = await open_lease(self.peers, request, self._background)
            # NOTE: the decode holds the blocks it shares with another completion of the
            # prompt already: the exports start after them.
            request.num_sent_blocks = lease.num_shared_blocks
            stub = self.peers.stub(request.decode_address, request.decode_instance_id)
            self.transfers.start(flight, stub)
        flight.window_place.leased()  # NOTE: or it needs none
        if constraint_state is not None:
            request.constraint_state = await asyncio.wrap_future(constraint_state)
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
            sampled = await flight.wait_first_token()
        flight.window_place.leave()
        token_id, index = sampled.token_id, request.first_token_index
        flight.outbox.put_nowait(
            FirstTokenOut(token_id, index, sampled.logprobs, sampled.prompt_logprobs)
        )
        finish = request.first_token_finish(token_id, self.eos_token_ids, self.max_model_len)
        sender = flight.sender
        if finish is None:
            assert sender is not None
            request.move_to(RequestStatus.TRANSFERRING)
            # NOTE: before the log line, which took 0.2 ms of the transfer's tail (first token to
            # the decode's commit acknowledged) here.
            sender.commit(token_id, index)
        log.info(
            "first_token",
            request_id=request.request_id,
            token_id=token_id,
            index=index,
            num_cached_tokens=request.num_cached_tokens,
            num_loaded_tokens=request.num_loaded_tokens,
        )
        if finish is not None:
            await release_lease(self.peers, request)
            request.move_to(RequestStatus.FINISHED)
            flight.outbox.put_nowait(FinishedOut(finish, request.num_prompt_tokens, index + 1))
            return
        assert sender is not None and flight.sender_task is not None
        assert request.lease is not None
        await flight.sender_task
        request.is_lease_open = False  # the decode owns it now
        request.move_to(RequestStatus.HANDED_OFF)
        flight.outbox.put_nowait(
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

    async def _take_turn(self, flight: InFlight) -> None:
        """Waits for the request's place in the lease window (in QUEUED: no lease, nothing in
        the engine yet), which it gives back once its prompt is computed."""
        request = flight.request
        num_tokens = self.loop.num_tokens_to_compute(request)
        num_ahead = self.window.num_tokens
        started, started_ns = time.monotonic(), time.time_ns()
        decode = request.decode_address if request.is_sending_kv else ""
        flight.window_place = await self.window.enter(num_tokens, decode)
        waited_s = time.monotonic() - started
        if flight.window_place.has_waited:
            # NOTE: a span only for a request that waited, drawn from when it began to.
            _tracer.start_span(
                "prefill.lease_turn",
                start_time=started_ns,
                attributes={
                    telemetry.REQUEST_ID: request.request_id,
                    "pdserve.num_tokens": num_tokens,
                    "pdserve.lease_window.num_tokens_ahead": num_ahead,
                },
            ).end()
            log.info(
                "lease_turn",
                request_id=request.request_id,
                waited_ms=round(waited_s * 1000, 1),
                num_tokens=num_tokens,
                num_tokens_ahead_on_arrival=num_ahead,
            )

    def _prepare_constraint(
        self, request: Request
    ) -> concurrent.futures.Future[ConstraintState] | None:
        constraint = request.sampling.constraint
        if constraint is None:
            return None
        if self.constraints is None:
            raise PdserveError(
                ErrorReason.INVALID_REQUEST,
                "this prefill's model has no tokenizer.json: it cannot apply a constraint",
                {"requestId": request.request_id},
            )
        completion = request.token_ids[request.num_prompt_tokens :]
        return self.constraints.prepare(constraint, completion)

    async def _cleanup(self, flight: InFlight, error: PdserveError | None) -> None:
        request = flight.request
        try:
            await self._release(flight)
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
                flight.outbox.put_nowait(error)

    # ---- giving back what a request holds --------------------------------------------------

    async def _release(self, flight: InFlight) -> None:
        """Gives back what the request holds: the decode lease unless handed off, the
        SyncCache stream, and the prefill's blocks (freed on the engine thread)."""
        request = flight.request
        if flight.window_place is not None:
            flight.window_place.leave()
        if request.is_lease_open:
            # NOTE: release before cancelling the stream, so the decode ends the lease as
            # released rather than as a broken transfer.
            await release_lease(self.peers, request)
        if flight.sender_task is not None:
            flight.sender_task.cancel()
            with contextlib.suppress(BaseException):
                await flight.sender_task
        if request.is_submitted:
            await free_blocks(self.loop, request, RELEASE_WAIT_S)
