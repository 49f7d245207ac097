"""Relays one instance stream into a request's progress, and gives up on lost instances.

A frozen instance (a SIGSTOPped process, a hung host) keeps its TCP connections open: its
streams neither yield nor fail, and gRPC keepalive does not notice in useful time. The registry
does notice, because the instance stops heartbeating; `LossWatch` turns that into an
interruption of every stream that depends on the instance, so the orchestrator can move the
request instead of waiting for its deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from typing import Any, TypeVar

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.decisions import Failed, Lost
from pdserve.gateway.fleet.backend import (
    BackendError,
    DecodeEvent,
    FinishedEvent,
    FirstTokenEvent,
    PreemptionEvent,
    PrefillEvent,
    TokenBatchEvent,
)
from pdserve.gateway.fleet.instance import InstanceRole
from pdserve.gateway.progress import CompletionProgress
from pdserve.gateway.request import TokenChunk
from pdserve.gateway.routing.pair import Pair

log = structlog.get_logger("pdserve.gateway.relay")

T = TypeVar("T")


class AttemptFailed(Exception):
    """A stream of the attempt failed with an error status or a transport failure.

    Attributes:
        role: Which instance of the pair failed (or was lost).
        failure: The error, and whether the server reported it itself.
    """

    def __init__(self, role: InstanceRole, failure: BackendError) -> None:
        super().__init__(str(failure))
        self.role = role
        self.failure = failure

    def setback(self, pair: Pair, num_delivered_tokens: int) -> Failed | Lost:
        """The attempt's outcome: `Failed` when the server reported it, else `Lost`.

        A lost connection's error says, for a person, which instance stopped answering and
        when; the transport's own words (``recvmsg: Connection reset by peer``) go to the log
        line ``instance_connection_lost`` only.
        """
        error = self.failure.error
        if self.failure.is_from_server:
            return Failed(self.role, pair, error, num_delivered_tokens)
        instance = pair.instance(self.role)
        log.info(
            "instance_connection_lost",
            role=self.role.value,
            instance_id=instance.instance_id,
            address=instance.address,
            num_generated_tokens=num_delivered_tokens,
            detail=error.message,
        )
        when = (
            f"after {num_delivered_tokens} generated tokens"
            if num_delivered_tokens
            else "before the first token"
        )
        message = (
            f"the {self.role.value} instance {instance.instance_id} ({instance.address}) "
            f"stopped answering {when}"
        )
        lost = PdserveError(
            ErrorReason.PEER_UNAVAILABLE, message, {"instanceId": instance.instance_id}
        )
        return Lost(self.role, pair, lost)


def connection_lost(role: InstanceRole, message: str) -> AttemptFailed:
    """An `AttemptFailed` for a stream that ended without its terminal event."""
    error = PdserveError(ErrorReason.PEER_UNAVAILABLE, message)
    return AttemptFailed(role, BackendError(error, is_from_server=False))


class InstanceLost(Exception):
    """An instance a stream depends on went silent past the registry's TTL."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(instance_id)
        self.instance_id = instance_id


class LossWatch:
    """Futures that resolve with an instance's id when the registry announces it lost."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Future[str]]] = {}

    def notify(self, instance_id: str) -> None:
        """Resolves every watcher of `instance_id` (a registry lost-listener)."""
        waiters = self._waiters.get(instance_id, ())
        if waiters:
            log.warning("streams_interrupted", instance_id=instance_id, num_streams=len(waiters))
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(instance_id)

    @property
    def num_watchers(self) -> int:
        """Open watches (each counted once per instance it watches)."""
        return sum(len(waiters) for waiters in self._waiters.values())

    @contextlib.contextmanager
    def watching(self, instance_ids: tuple[str, ...]) -> Iterator[asyncio.Future[str]]:
        """A future resolved with the first of `instance_ids` to be lost while inside."""
        waiter: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        for instance_id in instance_ids:
            self._waiters.setdefault(instance_id, set()).add(waiter)
        try:
            yield waiter
        finally:
            for instance_id in instance_ids:
                waiters = self._waiters.get(instance_id)
                if waiters is not None:
                    waiters.discard(waiter)
                    if not waiters:
                        del self._waiters[instance_id]


async def next_or_lost(events: AsyncIterator[T], lost: asyncio.Future[str]) -> T:
    """``anext(events)``, unless `lost` resolves first.

    Raises:
        StopAsyncIteration: `events` is exhausted.
        InstanceLost: `lost` resolved first; the pending step was cancelled (which closes the
            underlying call) before this returns.
    """
    if lost.done():
        raise InstanceLost(lost.result())
    # NOTE: the step runs in the caller's task, which `lost` cancels if it resolves while the
    # step waits. A task per step raced against `lost` (asyncio.wait) costs a task and three
    # more turns of the event loop per message: that is per token, for every stream.
    task = asyncio.current_task()
    assert task is not None
    interrupt = _Interrupt(task)
    lost.add_done_callback(interrupt)
    try:
        return await anext(events)
    except asyncio.CancelledError:
        # NOTE: a cancellation from elsewhere (too, or only) goes on as one.
        if not interrupt.has_cancelled or task.uncancel() > 0:
            raise
        raise InstanceLost(lost.result()) from None
    finally:
        interrupt.is_waiting = False
        lost.remove_done_callback(interrupt)


class _Interrupt:
    """`lost`'s callback: cancels the task while it waits in `next_or_lost`, and no later.

    A future's callbacks run in a later turn of the loop: by then the step may have returned,
    and the task must not be cancelled elsewhere.
    """

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.is_waiting = True
        self.has_cancelled = False

    def __call__(self, lost: asyncio.Future[str]) -> None:
        if self.is_waiting:
            self.has_cancelled = True
            self.task.cancel()


async def relay(
    role: InstanceRole,
    stream: AsyncGenerator[PrefillEvent, None] | AsyncGenerator[DecodeEvent, None],
    progress: CompletionProgress,
    watch: LossWatch,
    watched: Mapping[str, InstanceRole],
    end_grace_s: float,
    on_end: Callable[[FinishedEvent | PreemptionEvent], None] | None = None,
) -> AsyncGenerator[TokenChunk | PrefillEvent | DecodeEvent, None]:
    """Relays a stream: tokens go through `progress`, errors become `AttemptFailed`.

    A prefill's `FirstTokenEvent` is passed on as it arrives (for the phases it reports),
    followed by its token as a `TokenChunk`; every other event is passed on as is, except
    that with `on_end` (a decode's stream) the terminal event ends the relay: `on_end` is told
    it, and a preemption notice's tokens new to `progress` come as a last `TokenChunk`. A
    decode's stream then yields `TokenChunk`s only, straight to the orchestrator.

    Args:
        role: Whose stream this is.
        stream: The backend's event stream (closed when the relay ends).
        progress: Dedupes tokens by completion index.
        watch: Announces lost instances.
        watched: The instances the stream depends on, each with its role, so a loss is blamed
            on the right one.
        end_grace_s: Once the gateway has seen the completion end, how long to wait for the
            stream's terminal event; further tokens are ignored.
        on_end: Told a decode's terminal event (`FinishedEvent` or `PreemptionEvent`) as soon
            as it comes (the decode let go of the lease).

    Raises:
        AttemptFailed: The stream failed, skipped indices, or an instance it depends on was
            lost (then: a transport failure of that instance, PEER_UNAVAILABLE).
    """
    try:
        with watch.watching(tuple(watched)) as lost:
            while True:
                try:
                    if progress.finish_reason is None:
                        event = await next_or_lost(stream, lost)
                    else:
                        async with asyncio.timeout(end_grace_s):
                            event = await next_or_lost(stream, lost)
                except (StopAsyncIteration, TimeoutError):
                    return
                except BackendError as failure:
                    raise AttemptFailed(role, failure) from failure
                except InstanceLost as gone:
                    lost_role = watched.get(gone.instance_id, role)
                    message = f"{lost_role.value} instance {gone.instance_id} stopped heartbeating"
                    raise connection_lost(lost_role, message) from gone
                if isinstance(event, FirstTokenEvent | TokenBatchEvent):
                    if isinstance(event, FirstTokenEvent):
                        yield event
                        logprobs = () if event.logprobs is None else (event.logprobs,)
                        accepted = progress.accept(
                            (event.token_id,), event.index, logprobs, event.prompt_logprobs
                        )
                    else:
                        accepted = progress.accept(
                            event.token_ids, event.first_index, event.logprobs
                        )
                    if accepted.chunk is not None:
                        yield accepted.chunk
                    if accepted.has_gap:
                        gap = PdserveError(
                            ErrorReason.INTERNAL, f"{role.value} skipped completion indices"
                        )
                        raise AttemptFailed(role, BackendError(gap, is_from_server=True))
                elif on_end is not None and isinstance(event, FinishedEvent | PreemptionEvent):
                    on_end(event)
                    if isinstance(event, PreemptionEvent):
                        accepted = progress.accept(event.generated_token_ids, 0)
                        if accepted.chunk is not None:
                            yield accepted.chunk
                    return
                else:
                    yield event
    finally:
        with contextlib.suppress(BackendError):
            await stream.aclose()
