"""What a prefill request exchanges: its decode lease, the engine thread's events about it,
and the outcomes its caller reads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason, TokenLogprobs
from pdserve.kv.transfer import KvPiece
from pdserve.kv.transports.offer import TransportOffer


@dataclass(frozen=True)
class LeaseGrant:
    """The decode's lease for one request (the Lease message without protobuf).

    ``transport_token`` is the lease's credential (every transport, ReleaseLease): never
    logged, and left out of ``repr``. ``transports`` are the decode's offers besides gRPC
    SyncCache, in its order of preference. ``num_shared_blocks`` leading blocks already hold
    the request's KV on the decode (shared with another completion of the prompt): the sender
    ships the blocks after them. The model's sliding-window layers' KV of the first
    ``num_window_skipped_blocks`` blocks is not shipped at all (the decode keeps only their
    window, in ``num_window_slots`` slots: an in-place writer puts those layers' KV of the
    blocks after the skipped ones into ``window_slot_ids``).
    """

    lease_id: str
    block_ids: tuple[int, ...]
    decode_instance_id: str
    transport_token: bytes = field(default=b"", repr=False)
    transports: tuple[TransportOffer, ...] = ()
    num_shared_blocks: int = 0
    num_window_skipped_blocks: int = 0
    num_window_slots: int = 0
    window_slot_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class FirstTokenSampled:
    """The last prompt position was computed and the first token sampled (at `sampled_at`,
    ``time.monotonic()`` on the engine thread), with its logprobs and the prompt's when the
    request asks for them."""

    token_id: int
    sampled_at: float = 0.0
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class EngineFailed:
    """The engine could not give the request its first token.

    Attributes:
        reason: Why, as the request's error: INTERNAL for a forward pass that raised,
            INSTANCE_DRAINING when a tensor-parallel rank is gone (the instance goes down as a
            whole, and the request may go on elsewhere), INVALID_REQUEST when the request
            itself cannot go on (its constraint refuses its completion, or its filters leave
            no token).
    """

    detail: str
    reason: ErrorReason = ErrorReason.INTERNAL


EngineEvent = KvPiece | FirstTokenSampled | EngineFailed
EventSink = Callable[[EngineEvent], None]


@dataclass(frozen=True)
class FirstTokenOut:
    """The first token, for the caller (sent before the transfer finishes)."""

    token_id: int
    index: int
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class HandedOffOut:
    """Terminal: the decode committed the KV and owns the request."""

    lease: LeaseGrant
    num_chunks: int
    num_bytes: int
    transport: str = "grpc"


@dataclass(frozen=True)
class FinishedOut:
    """Terminal: the first token ended the request; no decode runs."""

    reason: FinishReason
    num_prompt_tokens: int
    num_completion_tokens: int


Outcome = FirstTokenOut | HandedOffOut | FinishedOut | PdserveError
