"""One prefill request as one object: its life cycle, what it holds, what its caller reads.

A `Request` walks QUEUED -> PREPARING -> PREFILLING -> TRANSFERRING -> HANDED_OFF (or FINISHED
when the first token ends it, or FAILED / ABORTED from any open state); `move_to`/`end` allow
only what `TRANSITIONS` lists. Besides its tokens and blocks it holds the decode lease, the KV
sender, the outbox the servicer streams from, and `release()`, which gives all of it back.

Ownership: the event loop moves ``status`` and sets ``lease``; the engine thread owns
``block_ids``, ``num_computed_tokens``, ``num_cached_tokens``, ``num_loaded_tokens``,
``block_keys``, the stored payloads and ``num_sent_blocks`` from the moment the request is
submitted to it until it is released (the store lookup sets the keys and payloads just before).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
from opentelemetry.context import Context

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import SamplingParams
from pdserve.kv.transfer import KvPiece
from pdserve.prefill.events import (
    EngineEvent,
    EngineFailed,
    EventSink,
    FirstTokenSampled,
    LeaseGrant,
    Outcome,
)
from pdserve.prefill.phases import PhaseClock

if TYPE_CHECKING:
    from pdserve.prefill.decode_client import DecodePeers
    from pdserve.prefill.kv_sender import KvSender
    from pdserve.prefill.prefill_loop import PrefillLoop

log = structlog.get_logger(__name__)

RELEASE_WAIT_S = 30.0


class RequestStatus(enum.IntEnum):
    """Life cycle of a prefill request; values at or above HANDED_OFF are terminal."""

    QUEUED = 0
    PREPARING = 1  # leasing blocks on the target decode
    PREFILLING = 2  # waiting for or in forward passes; KV ships layer by layer
    TRANSFERRING = 3  # first token sampled; waiting for the decode to acknowledge the commit
    HANDED_OFF = 4
    FINISHED = 5  # the first token ended the request; no decode runs
    FAILED = 6
    ABORTED = 7

    @property
    def is_terminal(self) -> bool:
        return self >= RequestStatus.HANDED_OFF


_S = RequestStatus
_ENDINGS = frozenset({_S.FAILED, _S.ABORTED})  # possible in every open state
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    # NOTE: a request whose first token is known to end it takes no lease: QUEUED -> PREFILLING.
    _S.QUEUED: _ENDINGS | {_S.PREPARING, _S.PREFILLING},
    _S.PREPARING: _ENDINGS | {_S.PREFILLING},
    _S.PREFILLING: _ENDINGS | {_S.TRANSFERRING, _S.FINISHED},
    _S.TRANSFERRING: _ENDINGS | {_S.HANDED_OFF},
    **{status: frozenset() for status in RequestStatus if status.is_terminal},
}


class IllegalTransition(AssertionError):
    """A transition the state machine does not allow (a bug, never a client error)."""


@dataclass(eq=False)
class Request:
    """One prompt to prefill for one decode target.

    Attributes:
        request_id: The gateway's id.
        token_ids: The prompt followed by earlier completion tokens (a reschedule).
        num_prompt_tokens: Length of the original prompt within ``token_ids``.
        sampling: Sampling settings; ``max_tokens`` counts the whole completion.
        seed: Seed of every sampled position (``resolve_seed`` of the request's).
        decode_address: "host:port" of the target decode.
        decode_instance_id: The instance id the caller expects there ('' if not given).
        is_sending_kv: Whether the engine exports KV for the decode (False when the first
            token is known to end the request, so no lease is taken).
        sink: Receives the engine thread's events (must be thread-safe).
        status: Where the request is in its life cycle.
        lease: The decode lease once granted.
        block_ids: This prefill's blocks holding the request's KV.
        num_computed_tokens: Tokens whose KV is computed (or was found in the prefix cache).
        num_cached_tokens: Leading tokens whose KV came from the prefix cache (not computed).
        num_loaded_tokens: Tokens after those whose KV was loaded from the KV store.
        block_keys: Cluster-wide keys of the full blocks of ``token_ids`` (prefix cache or
            KV store on).
        stored_first_block: Logical block of ``stored_payloads[0]``.
        stored_payloads: Block payloads found in the KV store before admission (admission
            copies those it uses into the request's blocks and drops the list).
        pending_imports: Blocks admission gave stored payloads to, ``(block_id, payload)``;
            written into the cache before the request's first pass.
        num_sent_blocks: Leading logical blocks already exported to the sender.
        phases: When it arrived and reached each phase boundary (the engine thread sets the
            first scheduled pass).
        trace_context: Parent of the engine thread's spans for this request (None: untraced).
        submitted_ns: Wall-clock time it was handed to the engine thread (for queue spans).
        outbox: What its caller reads: `Outcome`s (the first token, then a handoff, a finish
            or a `PdserveError`).
        first_token: Resolved by the engine thread's first token (made by `engine_sink`).
        sender: Its KV sender once a lease is granted; ``sender_task`` runs it.
        task: The event-loop task that walks it through its states; ``cleanup_task`` releases
            what it holds.
        is_lease_open: Whether it holds a decode lease not yet handed off or released.
        is_submitted: Whether the engine thread knows it (so its blocks must be released).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int
    decode_address: str
    decode_instance_id: str = ""
    is_sending_kv: bool = True
    sink: EventSink = field(default=lambda event: None)
    status: RequestStatus = RequestStatus.QUEUED
    lease: LeaseGrant | None = None
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_loaded_tokens: int = 0
    block_keys: list[bytes] = field(default_factory=list)
    stored_first_block: int = 0
    stored_payloads: list[bytes] = field(default_factory=list, repr=False)
    pending_imports: list[tuple[int, bytes]] = field(default_factory=list, repr=False)
    num_sent_blocks: int = 0
    phases: PhaseClock = field(default_factory=PhaseClock)
    trace_context: Context | None = None
    submitted_ns: int = 0
    outbox: asyncio.Queue[Outcome] = field(default_factory=asyncio.Queue)
    first_token: asyncio.Future[int] | None = None
    sender: KvSender | None = None
    sender_task: asyncio.Task[object] | None = None
    task: asyncio.Task[None] | None = None
    cleanup_task: asyncio.Task[None] | None = None
    is_lease_open: bool = False
    is_submitted: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def first_token_index(self) -> int:
        """Completion index of the token this prefill samples."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_new_tokens(self) -> int:
        """Tokens the completion may still grow by, the first token included."""
        return self.sampling.max_tokens - self.first_token_index

    @property
    def is_prefilled(self) -> bool:
        return self.num_computed_tokens >= self.num_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    # ---- transitions (on the event loop) ---------------------------------------------------

    def can_move_to(self, status: RequestStatus) -> bool:
        """Whether `status` may follow the current one."""
        return status in TRANSITIONS[self.status]

    def move_to(self, status: RequestStatus) -> None:
        """Moves to `status`.

        Raises:
            IllegalTransition: If the state machine does not allow it.
        """
        if not self.can_move_to(status):
            raise IllegalTransition(f"{self.status.name} -> {status.name}")
        self.status = status
        if status is RequestStatus.HANDED_OFF:
            self.phases.handed_off = time.monotonic()

    def end(self, status: RequestStatus) -> bool:
        """Ends it as FAILED or ABORTED; False if it had ended already (its caller then knows
        how it ended). `release()` gives back what it holds, lease included.

        Raises:
            IllegalTransition: For any other `status`.
        """
        if status not in _ENDINGS:
            raise IllegalTransition(f"{self.status.name} -> {status.name}")
        if self.status.is_terminal:
            return False
        self.move_to(status)
        return True

    # ---- the engine thread's events --------------------------------------------------------

    def engine_sink(self) -> EventSink:
        """What the engine thread calls with its events (they hop to the running event loop)."""
        aio_loop = asyncio.get_running_loop()
        self.first_token = aio_loop.create_future()

        def sink(event: EngineEvent) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: shutting down
                aio_loop.call_soon_threadsafe(self.on_engine_event, event)

        return sink

    def on_engine_event(self, event: EngineEvent) -> None:
        """Dispatches an engine-thread event (runs on the event loop)."""
        assert self.first_token is not None
        if isinstance(event, KvPiece):
            if self.sender is not None and not self.status.is_terminal:
                self.sender.put(event)
        elif self.first_token.done() or self.status.is_terminal:
            return
        elif isinstance(event, FirstTokenSampled):
            # NOTE: when it was sampled, not when the (possibly busy) event loop saw it.
            self.phases.first_token = event.sampled_at or time.monotonic()
            self.first_token.set_result(event.token_id)
        elif isinstance(event, EngineFailed):
            self.first_token.set_exception(PdserveError(ErrorReason.INTERNAL, event.detail))

    async def wait_first_token(self) -> int:
        """The first token; fails early if the transfer broke before it was sampled."""
        assert self.first_token is not None
        waiters: set[asyncio.Future[object]] = {self.first_token}  # type: ignore[arg-type]
        if self.sender_task is not None:
            waiters.add(self.sender_task)
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if self.first_token.done():
            return self.first_token.result()
        assert self.sender_task is not None
        self.sender_task.result()  # raises the transfer's error
        raise PdserveError(ErrorReason.INTERNAL, "the transfer ended before the first token")

    # ---- giving back what it holds ---------------------------------------------------------

    async def release_lease(self, peers: DecodePeers) -> None:
        """Releases the decode lease unless it was handed off or released already."""
        if not self.is_lease_open or self.lease is None:
            return
        self.is_lease_open = False
        await peers.release_lease(self.decode_address, self.lease, self.request_id)

    async def release(self, peers: DecodePeers, loop: PrefillLoop) -> None:
        """Gives back what it holds: the decode lease unless handed off, the SyncCache stream,
        and the prefill's blocks (freed on the engine thread)."""
        if self.is_lease_open:
            # NOTE: release before cancelling the stream, so the decode ends the lease as
            # released rather than as a broken transfer.
            await self.release_lease(peers)
        if self.sender_task is not None:
            self.sender_task.cancel()
            with contextlib.suppress(BaseException):
                await self.sender_task
        if self.is_submitted:
            await self._free_blocks(loop)

    async def _free_blocks(self, loop: PrefillLoop) -> None:
        aio_loop = asyncio.get_running_loop()
        released = aio_loop.create_future()

        def on_released() -> None:
            with contextlib.suppress(RuntimeError):
                aio_loop.call_soon_threadsafe(_resolve, released)

        loop.release(self, on_released)
        try:
            await asyncio.wait_for(released, RELEASE_WAIT_S)
        except TimeoutError:
            log.error("prefill_blocks_not_released", request_id=self.request_id)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
