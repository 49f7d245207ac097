"""Decode events, leases and request states as pdserve.v1 messages."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import cast

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import TokenLogprobs
from pdserve.decode.events import (
    DecodeEvent,
    EndedEvent,
    FinishedEvent,
    PreemptedEvent,
    PreemptionReason,
    TokensEvent,
)
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.request import DecodeRequest
from pdserve.engine.window_slots import WindowSlots
from pdserve.kv.transports.offer import TransportOffer
from pdserve.serving.convert import finish_reason_to_proto, logprobs_to_proto
from pdserve.serving.transports import transport_to_proto
from pdserve.v1 import common_pb2, decode_pb2

_PREEMPTION_REASONS = {
    PreemptionReason.OUT_OF_BLOCKS: decode_pb2.PREEMPTION_REASON_OUT_OF_BLOCKS,
    PreemptionReason.DRAINING: decode_pb2.PREEMPTION_REASON_DRAINING,
}
_ENDED_REASONS = {
    RequestStatus.ABORTED: ErrorReason.CANCELLED,
    RequestStatus.EXPIRED: ErrorReason.LEASE_EXPIRED,
    RequestStatus.FAILED: ErrorReason.INTERNAL,
}

Response = decode_pb2.DecodeServiceGenerateResponse


def lease_state_to_proto(status: RequestStatus | None) -> decode_pb2.LeaseState:
    """LeaseState message value of a request status (UNSPECIFIED for None)."""
    if status is None:
        return decode_pb2.LEASE_STATE_UNSPECIFIED
    return cast(decode_pb2.LeaseState, decode_pb2.LeaseState.Value(f"LEASE_STATE_{status.name}"))


def lease_to_proto(
    request: DecodeRequest,
    block_size: int,
    ttl_s: float,
    instance_id: str,
    offers: Sequence[TransportOffer] = (),
    window_slots: WindowSlots | None = None,
) -> decode_pb2.Lease:
    """The Lease message granting `request`'s blocks: the `offers` in order, then gRPC
    SyncCache, each with the lease's token (never log this message: the token is the lease's
    only credential); with the cache's `window_slots`, the slots its window blocks hold."""
    ttl_ms = round(ttl_s * 1000)
    slot_ids = (
        []
        if window_slots is None
        else [window_slots.slot_of(b) for b in request.block_ids[request.num_window_released :]]
    )
    transports = [
        transport_to_proto(offer, request.lease_token, request.block_ids, slot_ids)
        for offer in offers
    ]
    return decode_pb2.Lease(
        lease_id=request.lease_id,
        block_ids=request.block_ids,
        block_size=block_size,
        expires_at_unix_ms=int(time.time() * 1000) + ttl_ms,
        ttl_ms=ttl_ms,
        transports=[
            *transports,
            decode_pb2.Transport(
                kind=decode_pb2.TRANSPORT_KIND_GRPC_SYNC_CACHE, token=request.lease_token
            ),
        ],
        decode_instance_id=instance_id,
        num_shared_blocks=request.num_shared_blocks,
        num_window_skipped_blocks=request.num_window_released,
        num_window_slots=0 if window_slots is None else window_slots.num_slots,
        window_slot_ids=slot_ids,
    )


def events_to_messages(
    events: Sequence[DecodeEvent],
) -> Iterator[tuple[Response | None, PdserveError | None]]:
    """Turns decode events into stream messages, merging consecutive tokens into one batch.

    Yields ``(message, None)`` for messages to send and ``(None, error)`` for an ending that
    the stream reports as an error status.
    """
    pending: list[int] = []
    pending_logprobs: list[TokenLogprobs] = []
    first_index = 0
    for event in events:
        if isinstance(event, TokensEvent):
            if not pending:
                first_index = event.first_index
            pending.extend(event.token_ids)
            pending_logprobs.extend(event.logprobs)
            continue
        if pending:
            yield _tokens(pending, first_index, pending_logprobs), None
            pending, pending_logprobs = [], []
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
                stored_prefix_key=event.stored_prefix_key,
            )
            yield Response(preemption=notice), None
        elif isinstance(event, EndedEvent):
            reason = event.reason or _ENDED_REASONS[event.status]
            yield None, PdserveError(reason, event.detail or f"lease {event.status.name.lower()}")
        return  # a terminal event ends the stream
    if pending:
        yield _tokens(pending, first_index, pending_logprobs), None


def _tokens(token_ids: list[int], first_index: int, logprobs: list[TokenLogprobs]) -> Response:
    return Response(
        tokens=decode_pb2.TokenBatch(
            token_ids=token_ids,
            first_index=first_index,
            logprobs=[logprobs_to_proto(lp) for lp in logprobs],
        )
    )
