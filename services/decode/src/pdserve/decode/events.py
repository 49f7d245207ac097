"""What a decode request tells its Generate stream: tokens, then one terminal event.

They are queued on the request's `RequestEvents` (`emit` from the decode thread, `deliver` on
the event loop); `convert` turns them into pdserve.v1 messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.common.errors import ErrorReason
from pdserve.common.generation import FinishReason, TokenLogprobs
from pdserve.decode.lease_state import RequestStatus


class PreemptionReason(enum.Enum):
    """Why a request was preempted."""

    OUT_OF_BLOCKS = "out_of_blocks"
    DRAINING = "draining"


@dataclass(frozen=True)
class TokensEvent:
    """New tokens; ``first_index`` is the completion index of ``token_ids[0]``; ``logprobs``
    has one entry per token when the request asks for logprobs, else none."""

    token_ids: tuple[int, ...]
    first_index: int
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class FinishedEvent:
    """Terminal: generation ended."""

    finish_reason: FinishReason
    num_prompt_tokens: int
    num_completion_tokens: int


@dataclass(frozen=True)
class PreemptedEvent:
    """Terminal: preempted after every token in ``generated_token_ids`` was emitted.

    ``stored_prefix_key`` is the hex key of the last block offloaded to the KV store ('' when
    nothing was stored in time).
    """

    reason: PreemptionReason
    generated_token_ids: tuple[int, ...]
    stored_prefix_key: str = ""


@dataclass(frozen=True)
class EndedEvent:
    """Terminal: the request ended without finishing (aborted, expired or failed).

    ``reason`` overrides the error reason the status implies (e.g. CACHE_SYNC_FAILED).
    """

    status: RequestStatus
    detail: str = ""
    reason: ErrorReason | None = None


DecodeEvent = TokensEvent | FinishedEvent | PreemptedEvent | EndedEvent
