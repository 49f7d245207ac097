"""One request on the decode: its lease, its stream and its generation, as states of one object.

A `DecodeRequest` is created by AllocateBlocks and lives until its Generate stream has read its
terminal event. Its status walks ALLOCATED -> SYNCING -> COMMITTED -> RUNNING -> one terminal
state; `can_move_to`/`move_to` allow only the transitions `lease_state.TRANSITIONS` lists, and
`end()` is the one place its blocks go back to the pool, once. The lease table, the servicer,
the KV receiver and the decode thread hold references to it. Transitions run under the lease
table's lock (`LeaseManager.advance`/`end`). What it tells its Generate stream goes through
its `events` (`request_events.RequestEvents`: the queue, its delivery, which stream owns it).

A resumable request (contract 1.9) outlives its stream: it runs on detached when the stream
breaks, and a resuming stream attaches with a new epoch, taking it over from a stream still
attached. Such a stream reads ``token_ids`` and the recorded terminal event, since
the stream it took over may still take events off the queue.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import SamplingParams
from pdserve.common.pki import Identity
from pdserve.common.transitions import IllegalTransition, check_transition
from pdserve.decode.lease_state import TRANSITIONS, RequestStatus
from pdserve.decode.request_events import RequestEvents
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.constraints import ConstraintState

_tracer = telemetry.tracer("pdserve.decode")


@dataclass(eq=False)
class DecodeRequest:
    """One request on this decode, from its lease to its last event.

    Attributes:
        lease_id: Unique id on this instance.
        request_id: The gateway's request id.
        block_ids: Its block table (logical block i -> physical block_ids[i]); empty once ended.
        num_kv_tokens: Tokens whose KV the prefill ships (prompt and earlier completion).
        max_new_tokens: Tokens it may still generate when leased.
        expires_at: Monotonic deadline for commit and attach.
        lease_token: The unguessable token a SyncCache (or ReleaseLease) must present
            (`lease_access`); never logged, and left out of ``repr``.
        allocated_by: The certified identity that allocated it; None on a plaintext plane.
        peer_key: Whose share of the pool it counts against while uncommitted.
        status: Where it is in its life cycle.
        num_computed_tokens: Tokens with KV in the cache (grows while decoding).
        num_remaining_tokens: Tokens still to generate (shrinks while decoding).
        is_attached: Whether a Generate stream is attached.
        is_resumable: Its first Generate stream asked for a request that outlives it (it
            then runs on, detached, when that stream breaks).
        detached_at: Monotonic time its last stream broke before its end (None while a
            stream is attached, before one is, or once it ended with none).
        events: What it tells its Generate stream, and which stream owns it.
        ended_at: Monotonic time it reached a terminal status.
        token_ids: Prompt, earlier completion tokens, then every token generated so far; the
            last one is fed next (set at commit).
        num_prompt_tokens: Length of the original prompt within ``token_ids``.
        sampling: Sampling settings; ``max_tokens`` counts the whole completion.
        seed: The seed used for every position.
        span: Its ``decode.generation`` span (commit to end).
        num_steps: Decode steps it took part in (one token each).
        is_being_written: A KV transfer may be writing into its blocks (from `begin_sync`
            until the transfer ends); ending it meanwhile keeps the blocks until then.
        constraint_state: Its constraint's matcher (``sampling.constraint`` set), compiled
            and advanced over the completion it arrived with before the commit.
        share_key: Requests with the same key are completions of one prompt ('' for none).
        num_shared_blocks: Leading blocks of ``block_ids`` it references in another lease
            of its share key (full prompt blocks, never written by either).
        shared_token_ids: The tokens whose KV those blocks hold (its header must agree).
        num_window_released: Leading blocks of ``block_ids`` without the sliding-window
            layers' KV on a decode that keeps only their window (`sliding_kv`): never sent
            (``Lease.num_window_skipped_blocks`` at the grant) or let go since.
    """

    lease_id: str
    request_id: str
    block_ids: list[int]
    num_kv_tokens: int
    max_new_tokens: int
    expires_at: float
    lease_token: bytes = field(default=b"", repr=False)
    allocated_by: Identity | None = None
    peer_key: str = ""
    status: RequestStatus = RequestStatus.ALLOCATED
    num_computed_tokens: int = 0
    num_remaining_tokens: int = 0
    is_attached: bool = False
    is_resumable: bool = False
    detached_at: float | None = None
    events: RequestEvents = field(default_factory=RequestEvents)
    ended_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    span: trace.Span = trace.INVALID_SPAN
    num_steps: int = 0
    is_being_written: bool = False
    constraint_state: ConstraintState | None = field(default=None, repr=False)
    share_key: str = ""
    num_shared_blocks: int = 0
    shared_token_ids: tuple[int, ...] = field(default=(), repr=False)
    num_window_released: int = 0

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_detached(self) -> bool:
        """Its stream broke before its end and none has resumed it yet."""
        return self.detached_at is not None

    # ---- transitions (callers hold the lease table's lock) ---------------------------------

    def can_move_to(self, status: RequestStatus) -> bool:
        """Whether `status` may follow the current one."""
        return status in TRANSITIONS[self.status]

    def move_to(self, status: RequestStatus) -> None:
        """Moves to non-terminal `status` (terminal ones go through `end`).

        Raises:
            IllegalTransition: If the state machine does not allow it.
        """
        if status.is_terminal:
            raise IllegalTransition(self.status, status)
        check_transition(TRANSITIONS, self.status, status)
        self.status = status

    def end(self, status: RequestStatus, pool: BlockPool | None) -> bool:
        """Moves to terminal `status` and frees its blocks into `pool`, once (`pool` None:
        keeps them, for the caller to free later).

        Returns:
            True if this call ended it; False if it had already ended.

        Raises:
            IllegalTransition: For a non-terminal `status`, or one its status cannot reach.
        """
        if self.status.is_terminal:
            return False
        if not status.is_terminal:
            raise IllegalTransition(self.status, status)
        check_transition(TRANSITIONS, self.status, status)
        self.status = status
        self.ended_at = time.monotonic()
        if pool is not None:
            self.free_blocks(pool)
        return True

    def free_blocks(self, pool: BlockPool) -> None:
        """Drops its reference to each of its blocks (a block shared with another lease stays
        in use there)."""
        pool.free(self.block_ids)
        self.block_ids = []
        self.num_shared_blocks = 0

    # ---- its generation and its stream -----------------------------------------------------

    def start_generation(
        self,
        token_ids: list[int],
        num_prompt_tokens: int,
        sampling: SamplingParams,
        seed: int,
        constraint_state: ConstraintState | None = None,
    ) -> None:
        """Sets what the decode thread generates from and starts the ``decode.generation``
        span (called on the event loop at commit)."""
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.sampling = sampling
        self.seed = seed
        self.constraint_state = constraint_state
        self.events.bind(asyncio.get_running_loop())
        # NOTE: a child of the SyncCache call whose commit starts the generation; it runs
        # until the request ends, well past the call (and past the gateway's Generate start).
        self.span = _tracer.start_span(
            "decode.generation",
            attributes={
                telemetry.REQUEST_ID: self.request_id,
                "pdserve.lease_id": self.lease_id,
                "pdserve.num_prompt_tokens": num_prompt_tokens,
                "pdserve.num_tokens": len(token_ids),
            },
        )

    async def attach(self, *, is_resumable: bool = False) -> int:
        """Attaches the first Generate stream; waits for the commit, bounded by the lease TTL.

        Returns:
            The stream's attach epoch.

        Raises:
            PdserveError: INVALID_REQUEST if a stream is or was attached already,
                LEASE_EXPIRED if neither the commit nor an ending came within the TTL.
        """
        if self.is_attached or self.events.attach_epoch > 0:
            raise PdserveError(
                ErrorReason.INVALID_REQUEST,
                "another Generate stream is attached to this lease"
                if self.is_attached
                else "this lease had a Generate stream; resume it instead",
                {"leaseId": self.lease_id},
            )
        self.is_attached = True
        self.is_resumable = is_resumable
        epoch = self.events.new_epoch()
        await self._wait_ready()
        return epoch

    async def resume(self) -> tuple[int, bool]:
        """Attaches a resuming stream to a resumable request, taking it over from a stream
        still attached (that one sees `events.is_current` turn False); waits for the commit like
        `attach`.

        Returns:
            The new stream's attach epoch, and whether it took over an attached stream.

        Raises:
            PdserveError: INVALID_REQUEST if the request is not resumable, LEASE_EXPIRED as
                `attach`.
        """
        if not self.is_resumable:
            raise PdserveError(
                ErrorReason.INVALID_REQUEST,
                "the request is not resumable (its first Generate did not ask for it)",
                {"leaseId": self.lease_id},
            )
        is_taken_over = self.is_attached
        self.is_attached = True
        self.detached_at = None
        epoch = self.events.new_epoch()
        await self._wait_ready()
        return epoch, is_taken_over

    def detach(self) -> None:
        """Its stream went away before its end: it runs on, kept for a resume."""
        self.is_attached = False
        self.detached_at = time.monotonic()

    def completion_token_ids(self, start: int = 0) -> list[int]:
        """Completion tokens from completion index `start` on (earlier attempts' tokens and
        the prefill's first token included)."""
        # NOTE: the decode thread appends to token_ids before it emits each token's event;
        # slicing a list is atomic under the GIL, so a reader sees a prefix of what comes.
        return self.token_ids[self.num_prompt_tokens + start :]

    async def _wait_ready(self) -> None:
        timeout = max(0.0, self.expires_at - time.monotonic())
        try:
            await asyncio.wait_for(self.events.ready.wait(), timeout)
        except TimeoutError:
            if self.events.is_empty():
                raise PdserveError(
                    ErrorReason.LEASE_EXPIRED,
                    "no commit within the lease TTL",
                    {"leaseId": self.lease_id},
                ) from None

    def end_span(self, attributes: dict[str, str] | None = None) -> None:
        """Ends its ``decode.generation`` span with what it did and how it ended.

        Called before the terminal event is emitted, so the span ends before the request's
        Generate stream does.
        """
        self.span.set_attributes(
            {
                "pdserve.lease_state": self.status.name,
                "pdserve.num_steps": self.num_steps,
                # NOTE: every step samples one token for each request in the batch.
                "pdserve.num_generated_tokens": self.num_steps,
                "pdserve.num_completion_tokens": self.num_generated_tokens,
                **(attributes or {}),
            }
        )
        self.span.end()
