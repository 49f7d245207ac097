"""A prefill request, its life cycle, and the events the engine thread sends about it.

Ownership: the event loop sets ``status`` and ``lease``; the engine thread owns ``block_ids``,
``num_computed_tokens`` and ``num_sent_blocks`` from the moment the request is submitted to it
until it is released.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context

from pdserve.common.generation import FinishReason, SamplingParams, check_stop, is_length_reached
from pdserve.serving.kv_transfer import KvPiece


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


@dataclass(frozen=True)
class LeaseGrant:
    """The decode's lease for one request (the Lease message without protobuf)."""

    lease_id: str
    block_ids: tuple[int, ...]
    decode_instance_id: str
    transport_token: bytes = b""


@dataclass(frozen=True)
class FirstTokenSampled:
    """The last prompt position was computed and the first token sampled."""

    token_id: int


@dataclass(frozen=True)
class EngineFailed:
    """A forward pass that included the request raised."""

    detail: str


EngineEvent = KvPiece | FirstTokenSampled | EngineFailed
EventSink = Callable[[EngineEvent], None]


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
        num_computed_tokens: Tokens whose KV is computed.
        num_sent_blocks: Leading logical blocks already exported to the sender.
        trace_context: Parent of the engine thread's spans for this request (None: untraced).
        submitted_ns: Wall-clock time it was handed to the engine thread (for queue spans).
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
    num_sent_blocks: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    trace_context: Context | None = None
    submitted_ns: int = 0

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


def is_length_capped(request: Request, max_model_len: int) -> bool:
    """Whether the first token ends the request whatever it is (max_tokens or model length)."""
    return is_length_reached(
        request.first_token_index + 1, request.sampling, request.num_tokens + 1, max_model_len
    )


def first_token_finish(
    request: Request, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> FinishReason | None:
    """Why the first token ends the request, or None when the decode continues it (the one
    stop rule, `check_stop`, at the first token's completion index)."""
    return check_stop(
        token_id,
        request.first_token_index + 1,
        request.sampling,
        eos_token_ids,
        num_tokens=request.num_tokens + 1,
        max_model_len=max_model_len,
    )
