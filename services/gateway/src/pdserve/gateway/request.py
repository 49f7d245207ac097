"""Plain data the gateway's core works on: a prepared request and its output.

The REST and gRPC front ends build a `GenerationRequest`; the orchestrator runs it and yields
`TokenChunk`s and one `GenerationEnd`; the streamer turns them into `OutputDelta`s. Nothing
here knows about protobuf or HTTP; sampling settings and finish reasons are the services'
shared ones (`pdserve.common.generation`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.generation import FinishReason, SamplingParams, TokenLogprobs
from pdserve.gateway.tools.spec import ToolCallDelta


class ApiKind(enum.StrEnum):
    """Which API a request came through. The value is what a resumable request's record
    stores (`pdserve.gateway.session.store.ResumeRecord.kind`)."""

    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"
    GRPC = "grpc"


class ResponseStatus(enum.StrEnum):
    """Where a response stands: the Responses API's ``status``, and how a resumable request
    ended in its record (`pdserve.gateway.session.store.StoredEnd.status`)."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class GenerationRequest:
    """One client request, validated and tokenized, as the orchestrator runs it.

    Attributes:
        request_id: Gateway-assigned id, the same for every attempt of the request.
        model: Served model name.
        prompt_token_ids: The prompt (after chat templating).
        sampling: Sampling settings; the seed is always set (the gateway draws one when the
            client gives none), so a rescheduled request continues with the same tokens.
        eos_token_ids: The model's end-of-sequence ids (they end the completion unless
            ``sampling.ignore_eos``).
        share_key: The same for every completion of one prompt of a request with ``n`` > 1
            ('' otherwise): they are routed to one decode where they can, which then holds
            the prompt's full KV blocks once for all of them.
    """

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    share_key: str = ""


@dataclass(frozen=True)
class Placement:
    """Where a request's tokens are generated: a decode's lease."""

    decode_instance_id: str
    decode_address: str
    lease_id: str


@dataclass
class Resumable:
    """How a resumable request runs: its decode keeps generating when the gateway's stream to
    it breaks (the gateway died, or left it), so that another gateway can attach.

    Attributes:
        on_placed: Told each time a decode takes the request (for the shared record).
        attach_to: Where a previous gateway left it running: the run attaches there first,
            and continues through a prefill (from the tokens it got) where that fails.
        is_left: The gateway leaves it to others (it stops): closing the run keeps its decode
            lease (the decode holds the request for the next gateway) instead of releasing it.
    """

    on_placed: Callable[[Placement], None]
    attach_to: Placement | None = None
    is_left: bool = False


@dataclass(frozen=True)
class Usage:
    """Exact token accounting of one completion (retried work is never counted twice)."""

    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_prompt_tokens: int = 0

    @property
    def num_total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.num_prompt_tokens + self.num_completion_tokens


@dataclass(frozen=True)
class TokenChunk:
    """New completion tokens, never seen before by the consumer.

    Attributes:
        token_ids: The tokens, in order.
        first_index: Completion index of ``token_ids[0]`` (the number of tokens before it).
        logprobs: One entry per token when the request asks for logprobs (an entry may be
            missing only where an instance sent none).
        prompt_logprobs: The prompt's logprobs, on the completion's first chunk, when asked.
    """

    token_ids: tuple[int, ...]
    first_index: int
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


@dataclass(frozen=True)
class GenerationEnd:
    """The completion is over.

    Attributes:
        finish_reason: Why it ended.
        num_completion_tokens: Completion tokens delivered in all.
        num_cached_prompt_tokens: Prompt tokens a prefix cache served on the last attempt.
        num_attempts: Prefill attempts it took (1 when nothing went wrong).
        num_reschedules: Reschedules after preemption or a lost decode.
        queued_s: Seconds it waited in the gateway's admission queue for a decode with room,
            over all its attempts.
    """

    finish_reason: FinishReason
    num_completion_tokens: int
    num_cached_prompt_tokens: int = 0
    num_attempts: int = 1
    num_reschedules: int = 0
    queued_s: float = 0.0


@dataclass(frozen=True)
class OutputDelta:
    """One step of a completion stream.

    Attributes:
        text: New text (may lag `token_ids`).
        token_ids: New completion tokens.
        first_index: Completion index of ``token_ids[0]`` (or the token count so far).
        finish_reason: Set on the last delta only.
        usage: Set on the last delta only.
        logprobs: One entry per token of `token_ids` when the request asks for logprobs.
        prompt_logprobs: The prompt's logprobs (first delta only, when asked).
        tool_calls: Steps of the tool calls read from the completion (a request with tools);
            `text` is then the text outside them.
        reasoning: Reasoning read from the completion (a chat of a thinking model:
            `pdserve.gateway.reasoning`); `text` is then the content after it.
    """

    text: str
    token_ids: tuple[int, ...]
    first_index: int
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    tool_calls: tuple[ToolCallDelta, ...] = ()
    reasoning: str = ""
