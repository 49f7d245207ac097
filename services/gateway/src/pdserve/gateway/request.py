"""Plain data the gateway's core works on: a prepared request, its sampling and its output.

The REST and gRPC front ends build a `GenerationRequest`; the orchestrator runs it and yields
`TokenChunk`s and one `GenerationEnd`. Nothing here knows about protobuf or HTTP.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.Enum):
    """Why a completion ended (the OpenAI ``finish_reason`` strings)."""

    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request, as sent to prefill and decode.

    Attributes:
        temperature: Softmax temperature (0 is greedy); None means the model default (1.0).
        top_p: Nucleus mass in (0, 1]; None disables.
        top_k: Keep the k most likely tokens; None or 0 disables.
        seed: Seed of the request's random stream. Always set: the gateway draws one when the
            client gives none, so a rescheduled request continues with the same tokens.
        max_tokens: Tokens to generate for the whole completion, across attempts.
        stop_token_ids: Ids that end the completion (included in the output).
        ignore_eos: Whether end-of-sequence ids are ignored.
    """

    seed: int
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    """One client request, validated and tokenized, as the orchestrator runs it.

    Attributes:
        request_id: Gateway-assigned id, the same for every attempt of the request.
        model: Served model name.
        prompt_token_ids: The prompt (after chat templating).
        sampling: Sampling settings with a fixed seed.
        eos_token_ids: The model's end-of-sequence ids (they end the completion unless
            ``sampling.ignore_eos``).
    """

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    eos_token_ids: tuple[int, ...] = ()

    def is_stop_token(self, token_id: int) -> bool:
        """Whether generating `token_id` ends this completion."""
        if token_id in self.sampling.stop_token_ids:
            return True
        return not self.sampling.ignore_eos and token_id in self.eos_token_ids


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
    """

    token_ids: tuple[int, ...]
    first_index: int


@dataclass(frozen=True)
class GenerationEnd:
    """The completion is over.

    Attributes:
        finish_reason: Why it ended.
        num_completion_tokens: Completion tokens delivered in all.
        num_cached_prompt_tokens: Prompt tokens a prefix cache served on the last attempt.
        num_attempts: Prefill attempts it took (1 when nothing went wrong).
        num_reschedules: Reschedules after preemption or a lost decode.
    """

    finish_reason: FinishReason
    num_completion_tokens: int
    num_cached_prompt_tokens: int = 0
    num_attempts: int = 1
    num_reschedules: int = 0
