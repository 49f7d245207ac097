"""What the orchestrator needs from prefill and decode instances, in plain data.

`Backend` is the seam between the orchestrator's logic and the wire: `pdserve.gateway.fleet.clients`
implements it over gRPC, and a test may implement it in memory. Every failure surfaces as a
`BackendError` that wraps the typed `PdserveError` and says who sent it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

from opentelemetry.context import Context

from pdserve.common.errors import PdserveError
from pdserve.common.generation import FinishReason, SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class PrefillCall:
    """One Prefill RPC: a prompt (plus earlier completion tokens) for a chosen decode.

    Attributes:
        token_ids: The prompt, followed on a reschedule by the completion tokens so far.
        num_prompt_tokens: Length of the original prompt within `token_ids`.
        trace_context: The attempt's trace context; the call's span becomes its child.
        share_key: The request's share key ('' for none; see `GenerationRequest`).
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    sampling: SamplingParams
    decode_address: str
    decode_instance_id: str
    trace_context: Context | None = None
    share_key: str = ""


@dataclass(frozen=True)
class DecodeCall:
    """One Generate RPC: a decode's stream of a lease's tokens.

    Attributes:
        trace_context: The attempt's trace context; the call's span becomes its child.
        resumable: The request outlives this stream: if the stream breaks, the decode keeps it
            running (detached) for a later `resume` (contract 1.9).
        resume: Attach to a resumable request instead (taking it over from a stream still
            attached): the first batch holds every completion token from index 0, then the
            live ones follow, then the terminal event.
    """

    request_id: str
    lease_id: str
    trace_context: Context | None = None
    resumable: bool = False
    resume: bool = False


@dataclass(frozen=True)
class PrefillPhases:
    """Where the prefill spent the attempt's time, in seconds (see PrefillPhases in
    prefill.proto): lease, queue and compute up to the first token; the transfer tail and its
    transport once handed off (None and "" before)."""

    lease_s: float
    queue_s: float
    compute_s: float
    transfer_tail_s: float | None = None
    transport: str = ""


@dataclass(frozen=True)
class FirstTokenEvent:
    """Prefill sampled the first token of this attempt (`phases`: None from a prefill that
    reports none)."""

    token_id: int
    index: int
    phases: PrefillPhases | None = None
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class HandedOffEvent:
    """The decode owns the request now; attach to it with `lease_id`."""

    lease_id: str
    decode_instance_id: str
    phases: PrefillPhases | None = None


@dataclass(frozen=True)
class FinishedEvent:
    """The completion ended (terminal event of a prefill or decode stream)."""

    finish_reason: FinishReason | None
    num_completion_tokens: int = 0
    num_cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class TokenBatchEvent:
    """Tokens a decode generated, starting at completion index `first_index` (with one
    `logprobs` entry per token when the request asks for them)."""

    token_ids: tuple[int, ...]
    first_index: int
    logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class PreemptionEvent:
    """The decode preempted the request after every token in `generated_token_ids`."""

    reason: str
    num_generated_tokens: int
    generated_token_ids: tuple[int, ...] = field(default=())


PrefillEvent: TypeAlias = FirstTokenEvent | HandedOffEvent | FinishedEvent
DecodeEvent: TypeAlias = TokenBatchEvent | PreemptionEvent | FinishedEvent


@dataclass(frozen=True)
class DecodeSnapshot:
    """What a decode holds of a request now (a Generate `snapshot`, contract 1.9).

    Attributes:
        token_ids: Every completion token so far, from completion index 0 (tokens generated
            before this decode, the prefill's first one included).
        end: The request's terminal event if it has ended, else None.
    """

    token_ids: tuple[int, ...]
    end: FinishedEvent | PreemptionEvent | None = None


class BackendError(Exception):
    """A failed call to an instance.

    Attributes:
        error: The typed error (re-created from the status, or derived from its code).
        is_from_server: True when the server itself failed the call (its status carried a
            pdserve.v1 ErrorInfo, or a code a live server sends); False when the connection was
            lost (connection refused or reset, a server that died or stopped mid-stream).
    """

    def __init__(self, error: PdserveError, *, is_from_server: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.is_from_server = is_from_server


class Backend(Protocol):
    """Calls to prefill and decode instances. Every method raises `BackendError` on failure.

    ``trace_context`` is the trace context of the attempt a call belongs to (None: the
    current one); with tracing on, each call is a CLIENT span under it.
    """

    def prefill(
        self, address: str, call: PrefillCall, timeout_s: float
    ) -> AsyncGenerator[PrefillEvent, None]:
        """Streams the events of one Prefill RPC; closing the iterator cancels the call."""
        ...

    async def abort_request(
        self,
        address: str,
        request_id: str,
        timeout_s: float,
        trace_context: Context | None = None,
    ) -> None:
        """Aborts a prefill request (PrefillService.AbortRequest)."""
        ...

    def generate(
        self, address: str, call: DecodeCall, timeout_s: float
    ) -> AsyncGenerator[DecodeEvent, None]:
        """Streams a decode's events for a lease; closing the iterator cancels the call."""
        ...

    async def snapshot(
        self, address: str, request_id: str, lease_id: str, timeout_s: float
    ) -> DecodeSnapshot:
        """A decode's tokens and terminal event for a lease, without attaching (contract
        1.9; a request that ended with an error raises that error)."""
        ...

    async def release_lease(
        self,
        address: str,
        lease_id: str,
        request_id: str,
        timeout_s: float,
        trace_context: Context | None = None,
    ) -> None:
        """Releases a decode lease (DecodeService.ReleaseLease, idempotent)."""
        ...
