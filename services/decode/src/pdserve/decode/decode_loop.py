"""The decode thread: continuous batching over committed requests, preemption with notices.

Each step admits committed requests (FCFS, up to ``max_num_seqs``), makes sure every running
request has a slot for its next token (preempting the newest running request when the pool is
short), runs one batched forward pass, samples, and emits one event per request to its stream.
Events of one request are emitted in order on this one thread, so a preemption notice always
follows every token of its request. Each request's ``decode.generation`` span (started at
commit) records its admission to the batch, its steps and tokens, and how it ended.
"""

from __future__ import annotations

import time
from collections import deque

import structlog
from opentelemetry import trace

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason, check_stop
from pdserve.decode.events import (
    EndedEvent,
    FinishedEvent,
    PreemptedEvent,
    PreemptionReason,
    TokensEvent,
)
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.leases import LeaseManager
from pdserve.decode.metrics import DecodeMetrics
from pdserve.decode.offload import PreemptionOffload
from pdserve.decode.request import DecodeRequest
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.parallel.group import TensorParallelError
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import NO_TOKEN, NO_TOKEN_DETAIL, Sampler, SamplingRow
from pdserve.engine.thread import EngineThread

log = structlog.get_logger(__name__)


class DecodeLoop(EngineThread):
    """Owns the running batch; runs on its own thread.

    Args:
        runner: Forward passes over the KV cache.
        leases: The lease table (shared with the event loop), whose lock guards transitions.
        max_num_seqs: Most requests per step.
        eos_token_ids: End-of-sequence ids of the model.
        max_model_len: Longest sequence served.
        metrics: Where step durations are observed, if anywhere.
        offload: Stores preempted requests' blocks in the KV store (None: no store).
    """

    def __init__(
        self,
        runner: ModelRunner,
        leases: LeaseManager,
        max_num_seqs: int,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        metrics: DecodeMetrics | None = None,
        offload: PreemptionOffload | None = None,
    ) -> None:
        self.runner = runner
        self.leases = leases
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.sampler = Sampler(eos_token_ids)
        self.metrics = metrics
        self.offload = offload
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_generated_tokens = 0
        self._running: list[DecodeRequest] = []
        self._waiting: deque[DecodeRequest] = deque()
        self._aborts: dict[str, tuple[RequestStatus, str]] = {}
        self._preempt_all: PreemptionReason | None = None
        self._is_broken = False
        super().__init__("decode-loop")

    # ---- called from other threads ---------------------------------------------------------

    def submit(self, request: DecodeRequest) -> None:
        """Queues a committed request for admission."""
        with self._cond:
            self._waiting.append(request)
            self._cond.notify()

    def abort(self, request: DecodeRequest, status: RequestStatus, detail: str = "") -> None:
        """Ends a running request at the next step boundary with terminal `status`."""
        with self._cond:
            self._aborts[request.lease_id] = (status, detail)
            self._cond.notify()

    def release(self, request: DecodeRequest, status: RequestStatus, detail: str = "") -> None:
        """Ends a request from the event loop in terminal `status`: at the next step boundary
        if it is RUNNING (this thread owns it then), else at once."""
        with self.leases.table.lock:
            if request.status is RequestStatus.RUNNING:
                self.abort(request, status, detail)
                return
            # NOTE: a COMMITTED request may sit in the waiting queue; ending it here makes its
            # COMMITTED -> RUNNING admission fail, so it is never decoded.
            is_ended = self.leases.table.end(request, status)
        if is_ended:
            request.events.deliver(EndedEvent(status, detail))

    def preempt_all(self, reason: PreemptionReason) -> None:
        """Preempts every queued and running request at the next step (used when draining)."""
        with self._cond:
            self._preempt_all = reason
            self._cond.notify()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._is_stopped
                    or (self._running and not self._is_broken)
                    or self._waiting
                    or self._aborts
                    or self._preempt_all
                ):
                    self._wait_for_work()
                aborts, self._aborts = self._aborts, {}
                is_stopping = self._is_stopped
                if not is_stopping:
                    preempt_reason = self._take_admissions()
            if is_stopping:
                # NOTE: outside the condition (ending a request takes the lease table's lock,
                # which `release` holds while it queues an abort). The aborts the stop queued
                # (its streams cancelled) end their requests and give their blocks back: a stop
                # that landed between two steps used to drop them.
                self._apply_aborts(aborts)
                if self._is_broken:
                    self._release_all()
                return
            try:
                self._apply_aborts(aborts)
                if preempt_reason is not None:
                    for request in reversed(self._running):
                        self._preempt(request, preempt_reason)
                if self._running and not self._is_broken:
                    self._step()
            except TensorParallelError as error:
                # NOTE: a lost rank takes the instance down (`InstanceServer`): its streams end
                # as the server stops, so that the gateway sees a lost decode (and migrates),
                # not failed requests; their leases are released as the streams are cancelled.
                log.error("decode_step_failed", error=str(error), reason="rank_lost")
                self._is_broken = True
            except Exception as error:
                log.exception("decode_step_failed", error=str(error))
                for request in list(self._running):
                    self._end(request, RequestStatus.FAILED, f"decode step failed: {error}")

    def _take_admissions(self) -> PreemptionReason | None:
        """Admits what waits (under the condition); the drain's preemption reason, where one
        was asked for."""
        preempt_reason, self._preempt_all = self._preempt_all, None
        if preempt_reason is not None:
            # Draining: every queued request is admitted so that it gets its notice.
            while self._waiting:
                self._admit(self._waiting.popleft())
        while self._waiting and len(self._running) < self.max_num_seqs:
            self._admit(self._waiting.popleft())
        return preempt_reason

    def _release_all(self) -> None:
        """Ends every request this loop holds (the instance is down: its streams are gone)."""
        while self._waiting:
            self._admit(self._waiting.popleft())
        for request in list(self._running):
            self._end(request, RequestStatus.ABORTED, "the instance lost a tensor-parallel rank")

    def _admit(self, request: DecodeRequest) -> None:
        if not self.leases.table.advance(request, RequestStatus.RUNNING):
            request.end_span()  # released or expired while waiting
            return
        self._running.append(request)
        request.span.add_event("scheduled", {"pdserve.num_running": len(self._running)})
        finish = self._check_stop(request)
        if finish is not None:
            self._finish(request, finish)

    def _apply_aborts(self, aborts: dict[str, tuple[RequestStatus, str]]) -> None:
        # NOTE: the waiting queue is only read on this thread after admission, so a request
        # ended while waiting is caught by the failed COMMITTED -> RUNNING transition.
        for request in [r for r in self._running if r.lease_id in aborts]:
            status, detail = aborts[request.lease_id]
            self._end(request, status, detail)

    def _step(self) -> None:
        # Make room for each request's next token, oldest first; preempt the newest if short.
        for request in list(self._running):
            if request not in self._running:
                continue
            needed = request.num_computed_tokens + 1
            while not self.leases.table.extend(request, needed):
                victim = self._running[-1]
                self._preempt(victim, PreemptionReason.OUT_OF_BLOCKS)
                if victim is request:
                    break
        if not self._running:
            return
        started = time.perf_counter()
        batch = list(self._running)
        chunks = [
            ScheduledChunk([r.token_ids[-1]], r.num_computed_tokens, r.block_ids, r) for r in batch
        ]
        logits = self.runner.execute(chunks)
        rows = self._sampling_rows(batch)
        if len(rows) < len(batch):  # a constraint refused a completion: that request ended
            kept = [i for i, r in enumerate(batch) if r in self._running]
            batch, logits = [batch[i] for i in kept], logits[kept]
        tokens = self.sampler.sample(logits, rows)
        self.num_steps += 1
        if self.metrics is not None:
            self.metrics.step_seconds.observe(time.perf_counter() - started)
        for request, picked in zip(batch, tokens, strict=True):
            token = picked.token_id
            if token == NO_TOKEN:
                self._end(
                    request, RequestStatus.FAILED, NO_TOKEN_DETAIL, ErrorReason.INVALID_REQUEST
                )
                continue
            self.num_generated_tokens += 1
            index = request.num_generated_tokens
            request.num_steps += 1
            request.token_ids.append(token)
            request.num_computed_tokens += 1
            request.num_remaining_tokens = request.sampling.max_tokens - (index + 1)
            logprobs = () if picked.logprobs is None else (picked.logprobs,)
            request.events.emit(TokensEvent((token,), index, logprobs))
            self.leases.table.release_window(request)
            finish = self._check_stop(request)
            if finish is not None:
                self._finish(request, finish)

    def _sampling_rows(self, batch: list[DecodeRequest]) -> list[SamplingRow]:
        """The rows of `batch`; a request whose completion its constraint refuses ends
        (FAILED) and has no row."""
        rows = []
        for r in batch:
            try:
                rows.append(
                    SamplingRow.of_sequence(
                        r.sampling, r.seed, r.token_ids, r.num_prompt_tokens, r.constraint_state
                    )
                )
            except PdserveError as error:
                self._end(r, RequestStatus.FAILED, error.message, error.reason)
        return rows

    def _check_stop(self, request: DecodeRequest) -> FinishReason | None:
        return check_stop(
            request.token_ids[-1],
            request.num_generated_tokens,
            request.sampling,
            self.eos_token_ids,
            num_tokens=len(request.token_ids),
            max_model_len=self.max_model_len,
        )

    def _finish(self, request: DecodeRequest, reason: FinishReason) -> None:
        self._running.remove(request)
        self.leases.table.end(request, RequestStatus.FINISHED)
        request.end_span({"pdserve.finish_reason": reason.value})
        request.events.emit(
            FinishedEvent(reason, request.num_prompt_tokens, request.num_generated_tokens)
        )

    def _preempt(self, request: DecodeRequest, reason: PreemptionReason) -> None:
        self._running.remove(request)
        event = PreemptedEvent(reason, tuple(request.token_ids[request.num_prompt_tokens :]))
        # NOTE: the offload copies the blocks out before `end` frees them.
        offload = None if self.offload is None else self.offload.start(request)
        self.leases.table.end(request, RequestStatus.PREEMPTED)
        self.num_preemptions += 1
        generated = event.generated_token_ids
        log.info(
            "request_preempted",
            request_id=request.request_id,
            reason=reason.value,
            num_generated_tokens=len(generated),
        )
        request.span.add_event(
            "preemption",
            {"pdserve.reason": reason.value, "pdserve.num_generated_tokens": len(generated)},
        )
        request.end_span()
        if self.offload is None:
            request.events.emit(event)
        else:
            self.offload.emit_notice(request, event, offload)

    def _end(
        self,
        request: DecodeRequest,
        status: RequestStatus,
        detail: str,
        reason: ErrorReason | None = None,
    ) -> None:
        """Ends `request` unfinished; `reason` overrides the error reason `status` implies."""
        self._running.remove(request)
        self.leases.table.end(request, status)
        if status is RequestStatus.FAILED:
            request.span.set_status(trace.Status(trace.StatusCode.ERROR, detail))
        request.end_span()
        request.events.emit(EndedEvent(status, detail, reason))
