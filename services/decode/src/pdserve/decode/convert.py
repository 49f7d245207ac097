"""Decode events and lease states as pdserve.v1 messages."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.decode.decode_loop import (
    DecodeEvent,
    EndedEvent,
    FinishedEvent,
    PreemptedEvent,
    PreemptionReason,
    TokensEvent,
)
from pdserve.decode.leases import LeaseState
from pdserve.serving.convert import finish_reason_to_proto
from pdserve.v1 import common_pb2, decode_pb2

_PREEMPTION_REASONS = {
    PreemptionReason.OUT_OF_BLOCKS: decode_pb2.PREEMPTION_REASON_OUT_OF_BLOCKS,
    PreemptionReason.DRAINING: decode_pb2.PREEMPTION_REASON_DRAINING,
}
_ENDED_REASONS = {
    LeaseState.ABORTED: ErrorReason.CANCELLED,
    LeaseState.EXPIRED: ErrorReason.LEASE_EXPIRED,
    LeaseState.FAILED: ErrorReason.INTERNAL,
}

Response = decode_pb2.DecodeServiceGenerateResponse


def lease_state_to_proto(state: LeaseState | None) -> decode_pb2.LeaseState.ValueType:
    """LeaseState message value (UNSPECIFIED for None)."""
    if state is None:
        return decode_pb2.LEASE_STATE_UNSPECIFIED
    return decode_pb2.LeaseState.Value(f"LEASE_STATE_{state.name}")


def events_to_messages(
    events: Sequence[DecodeEvent],
) -> Iterator[tuple[Response | None, PdserveError | None]]:
    """Turns decode events into stream messages, merging consecutive tokens into one batch.

    Yields ``(message, None)`` for messages to send and ``(None, error)`` for an ending that
    the stream reports as an error status.
    """
    pending: list[int] = []
    first_index = 0
    for event in events:
        if isinstance(event, TokensEvent):
            if not pending:
                first_index = event.first_index
            pending.extend(event.token_ids)
            continue
        if pending:
            yield _tokens(pending, first_index), None
            pending = []
        if isinstance(event, FinishedEvent):
            usage = common_pb2.Usage(
                num_prompt_tokens=event.num_prompt_tokens,
                num_completion_tokens=event.num_completion_tokens,
            )
            finished = common_pb2.Finished(
                finish_reason=finish_reason_to_proto(event.finish_reason), usage=usage
            )
            yield Response(finished=finished), None
        elif isinstance(event, PreemptedEvent):
            notice = decode_pb2.PreemptionNotice(
                reason=_PREEMPTION_REASONS[event.reason],
                num_generated_tokens=len(event.generated_token_ids),
                generated_token_ids=list(event.generated_token_ids),
            )
            yield Response(preemption=notice), None
        elif isinstance(event, EndedEvent):
            reason = event.reason or _ENDED_REASONS[event.state]
            yield None, PdserveError(reason, event.detail or f"lease {event.state.name.lower()}")
        return  # a terminal event ends the stream
    if pending:
        yield _tokens(pending, first_index), None


def _tokens(token_ids: list[int], first_index: int) -> Response:
    return Response(tokens=decode_pb2.TokenBatch(token_ids=token_ids, first_index=first_index))
