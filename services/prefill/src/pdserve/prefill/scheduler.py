"""Prefill-only scheduling: FCFS over prepared requests under a token budget per pass.

There is no decode path. A request is admitted when the pool can hold its whole prompt (its
blocks stay with it until its KV has been shipped, so admission never has to back out), the
oldest partially computed request continues first, several prompts share one pass, and a prompt
longer than what is left of the budget is cut into chunks that later passes continue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.common.generation import num_blocks_for
from pdserve.engine.block_pool import BlockPool
from pdserve.prefill.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """A request's share of one forward pass.

    Attributes:
        request: The request (its ``block_ids`` cover its whole prompt).
        num_computed_tokens: Tokens cached before this pass (the chunk's start position).
        num_new_tokens: Tokens computed in this pass.
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.request.token_ids[start : start + self.num_new_tokens]

    @property
    def completes_prompt(self) -> bool:
        """Whether the pass reaches the last position, whose logits give the first token."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """What one pass runs, oldest request first."""

    scheduled: list[ScheduledChunk] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class PrefillScheduler:
    """Chooses the chunks of each forward pass and owns the requests' prefill blocks.

    Args:
        pool: This prefill's block pool.
        block_size: Tokens per block.
        max_num_batched_tokens: Token budget of one pass.
    """

    def __init__(self, pool: BlockPool, block_size: int, max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted (blocks held), prompt not fully computed
        self.prefilled: dict[str, Request] = {}  # computed; blocks held until released

    def add_request(self, request: Request) -> None:
        """Queues a prepared request (FCFS)."""
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Picks the next pass: running requests first, then waiting ones in arrival order.

        Admission stops at the first waiting request whose prompt does not fit in the free
        blocks (strict FCFS: a long prompt is never starved by shorter ones behind it).
        """
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledChunk] = []
        for request in self.running:
            if budget == 0:
                break
            num_new = min(request.num_uncomputed_tokens, budget)
            scheduled.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget -= num_new
        while self.waiting and budget > 0:
            request = self.waiting[0]
            num_blocks = num_blocks_for(request.num_tokens, self.block_size)
            if not self.pool.can_allocate(num_blocks):
                break
            self.waiting.popleft()
            request.block_ids = self.pool.allocate(num_blocks)
            self.running.append(request)
            num_new = min(request.num_uncomputed_tokens, budget)
            scheduled.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget)

    def update_from_output(self, output: SchedulerOutput) -> list[Request]:
        """Advances the scheduled requests past their chunks.

        Returns:
            The requests whose prompt is now fully computed (they keep their blocks).
        """
        done: list[Request] = []
        for chunk in output.scheduled:
            request = chunk.request
            request.num_computed_tokens = chunk.num_computed_tokens + chunk.num_new_tokens
            if request.is_prefilled and request in self.running:
                self.running.remove(request)
                self.prefilled[request.request_id] = request
                done.append(request)
        return done

    def release(self, request: Request) -> bool:
        """Forgets a request at any stage and frees its blocks, once.

        Returns:
            True if the request was known to the scheduler.
        """
        known = False
        if request in self.waiting:
            self.waiting.remove(request)
            known = True
        if request in self.running:
            self.running.remove(request)
            known = True
        if any(r is request for r in self.prefilled.values()):
            del self.prefilled[request.request_id]
            known = True
        if request.block_ids:
            self.pool.free(reversed(request.block_ids))
            request.block_ids = []
        return known

    def fail(self, requests: list[Request]) -> None:
        """Stops computing `requests` (a pass that included them raised); blocks stay held."""
        for request in requests:
            if request in self.running:
                self.running.remove(request)
                self.prefilled[request.request_id] = request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def check_integrity(self) -> None:
        """Raises AssertionError unless the pool is consistent and exactly the admitted
        requests own its used blocks."""
        self.pool.check_integrity()
        owned = [b for r in (*self.running, *self.prefilled.values()) for b in r.block_ids]
        assert len(owned) == len(set(owned)), "a block is owned by two requests"
        assert len(owned) == self.pool.num_used_blocks, (
            f"requests own {len(owned)} blocks but the pool has {self.pool.num_used_blocks} used"
        )
        assert not any(r.block_ids for r in self.waiting), "a waiting request holds blocks"
