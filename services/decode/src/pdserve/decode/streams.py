"""The messages of a Generate stream, in its three shapes: live, resumed and snapshot.

A live stream (the request's first) passes the request's queued events through, logprobs
included. A resumed stream (`resume`, since 1.9) reads the request's ``token_ids`` and
``terminal`` instead and uses its events only as a wake-up: a stream it took over may still be
taking events off the queue. A snapshot reads the same state once and does not wait.

Each shape is an async iterator of messages that raises `PdserveError` for an ending the
stream reports as an error status (an `EndedEvent`, or a takeover of its request).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc
from opentelemetry import trace

from pdserve.common.errors import TAKEN_OVER_KEY, ErrorReason, PdserveError
from pdserve.decode import convert
from pdserve.decode.events import DecodeEvent
from pdserve.decode.request import DecodeRequest
from pdserve.v1 import decode_pb2

Response = decode_pb2.DecodeServiceGenerateResponse


def takeover_error(request: DecodeRequest) -> PdserveError:
    """The status a stream ends with when a `resume` stream took its request over."""
    return PdserveError(
        ErrorReason.CANCELLED,
        "another Generate stream resumed this request",
        {"leaseId": request.lease_id, TAKEN_OVER_KEY: "true"},
        code=grpc.StatusCode.ABORTED,
    )


async def live(request: DecodeRequest, epoch: int) -> AsyncIterator[Response]:
    """The request's events as they come, until its terminal event (the first stream)."""
    while True:
        events = await request.events.next_events(epoch)
        if not events:
            raise takeover_error(request)
        for message in _messages(events):
            if message.WhichOneof("event") == "preemption":
                count = message.preemption.num_generated_tokens
                trace.get_current_span().add_event(
                    "preemption", {"pdserve.num_generated_tokens": count}
                )
            yield message
            if message.WhichOneof("event") != "tokens":
                return


async def resumed(request: DecodeRequest, epoch: int) -> AsyncIterator[Response]:
    """Every completion token so far in one batch, then each later token, then the terminal
    event (replayed if it was delivered already)."""
    num_sent = 0
    is_first = True
    while True:
        if not request.events.is_current(epoch):
            raise takeover_error(request)
        # NOTE: taken before the state is read, so a change during the yields below is seen.
        changed = request.events.change_waiter()
        # NOTE: terminal first: once it is set, token_ids holds every token it follows.
        terminal = request.events.terminal
        token_ids = request.completion_token_ids(num_sent)
        request.events.take_events()  # dropped: read from token_ids and terminal instead
        if token_ids or is_first:
            yield _tokens(token_ids, num_sent)
            num_sent += len(token_ids)
            is_first = False
        if terminal is not None:
            for message in _messages([terminal]):
                yield message
            return
        await changed.wait()


async def snapshot(request: DecodeRequest) -> AsyncIterator[Response]:
    """Every completion token so far in one batch, then the terminal event if it came."""
    terminal = request.events.terminal
    yield _tokens(request.completion_token_ids(), 0)
    if terminal is not None:
        for message in _messages([terminal]):
            yield message


def _messages(events: list[DecodeEvent]) -> Iterator[Response]:
    """The events' messages; raises the error an ending reports, after the tokens before it."""
    for message, ending in convert.events_to_messages(events):
        if ending is not None:
            raise ending
        assert message is not None
        yield message


def _tokens(token_ids: list[int], first_index: int) -> Response:
    return Response(tokens=decode_pb2.TokenBatch(token_ids=token_ids, first_index=first_index))
