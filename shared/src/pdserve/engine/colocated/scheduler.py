"""The colocated `LLMEngine`'s continuous batching: prefill chunks and decodes under a budget.

The prefill and decode services do not use it: each schedules its own role
(`pdserve.prefill.scheduler`, `pdserve.decode.decode_loop`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import structlog

from pdserve.common.generation import FinishReason
from pdserve.engine.batch import ScheduledChunk, SchedulerOutput
from pdserve.engine.colocated.kv_cache_manager import KVCacheManager
from pdserve.engine.colocated.request import Request, RequestStatus
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.sampler import NO_TOKEN

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RequestOutput:
    """The new tokens of one request after a step.

    Attributes:
        request_id: The request.
        new_token_ids: Tokens generated in this step (empty for a partial prefill chunk).
        finished: Whether the request has ended.
        finish_reason: Why it ended, or ``None``.
        num_output_tokens: Tokens generated so far, including ``new_token_ids``.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_output_tokens: int


class Scheduler:
    """Decides which requests run each step, with preemption by recompute (newest first).

    Args:
        config: Batching limits.
        kv_cache_manager: Block bookkeeping.
        max_model_len: Longest sequence (prompt plus output).
    """

    def __init__(
        self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        """Queues a request (it may already own blocks holding KV for its first tokens)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        """Requests waiting or running."""
        return len(self.requests)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Ends live requests (e.g. aborts) and frees their blocks; unknown ids are ignored."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def schedule(self) -> SchedulerOutput[Request]:
        """Builds the next step: running requests first, then waiting ones while room is left."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledChunk[Request]] = []
        preempted: list[str] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache_manager.allocate_slots(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledChunk.cut(request, num_new))
                budget -= num_new
                index += 1
        # NOTE: admitting new work right after a preemption would only thrash; wait a step.
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            hit_block_ids, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_computed = num_hit_tokens or request.num_computed_tokens
            num_new = request.num_tokens - num_computed
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv_cache_manager.allocate_slots(request, num_new, hit_block_ids):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledChunk.cut(request, num_new))
            budget -= num_new
        return SchedulerOutput(
            scheduled=scheduled,
            preempted_request_ids=preempted,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput[Request], sampled_token_ids: Mapping[str, int]
    ) -> list[RequestOutput]:
        """Advances the scheduled requests after the forward pass and applies stop rules.

        Args:
            scheduler_output: The step that ran.
            sampled_token_ids: The sampled token of each request whose chunk completed its
                known tokens (``ScheduledChunk.completes_prompt``).

        Returns:
            One output per scheduled request that is still tracked.
        """
        outputs = []
        for item in scheduler_output.scheduled:
            request = item.request
            if request.is_finished or request.status == RequestStatus.PREEMPTED:
                continue
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache_manager.cache_blocks(request)
            self.kv_cache_manager.release_window(request)
            new_token_ids: list[int] = []
            if item.completes_prompt:
                token_id = sampled_token_ids[request.request_id]
                if token_id == NO_TOKEN:  # its filters left no token: it cannot go on
                    status: RequestStatus | None = RequestStatus.FINISHED_ABORTED
                else:
                    request.append_output_token(token_id)
                    new_token_ids.append(token_id)
                    status = request.check_stop(self.max_model_len)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=new_token_ids,
                    finished=request.is_finished,
                    finish_reason=request.finish_reason,
                    num_output_tokens=request.num_output_tokens,
                )
            )
        return outputs

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        log.debug("request_preempted", request_id=request.request_id, num_tokens=request.num_tokens)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.kv_cache_manager.free(request)
        request.status = status
        del self.requests[request.request_id]
