"""A generation request of the colocated `LLMEngine` and its life cycle.

The prefill and decode services keep their own request types.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from pdserve.common.generation import FinishReason, SamplingParams, check_stop
from pdserve.engine.block_pool import BlockHash


class RequestStatus(enum.IntEnum):
    """Life cycle of a request; every status after ``PREEMPTED`` is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        """Whether the request has reached a terminal status."""
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}
_FINISHED_STATUSES = {reason: status for status, reason in _FINISH_REASONS.items()}


class Request:
    """One sequence: prompt, generated tokens and where its KV lives.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache; the last generated token
    is the next input, so a running request in decode has ``num_tokens - num_computed_tokens ==
    1``. A request resumed elsewhere passes its earlier output as ``output_token_ids``: the
    completion index of the next token, ``max_tokens`` and stop checks then continue from there.

    Args:
        request_id: Unique id.
        prompt_token_ids: The prompt.
        sampling_params: Sampling and stopping settings.
        seed: The effective sampling seed (``sampling_params.seed`` or one drawn at add time).
        output_token_ids: Tokens already generated for this request (a resume).
        block_ids: KV blocks the request already owns (e.g. KV imported from another process).
        num_computed_tokens: How many leading tokens have their KV in ``block_ids``.
        eos_token_ids: The model's end-of-sequence ids.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        seed: int,
        *,
        output_token_ids: Sequence[int] = (),
        block_ids: Sequence[int] = (),
        num_computed_tokens: int = 0,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids = list(output_token_ids)
        self.token_ids = self.prompt_token_ids + self.output_token_ids
        self.sampling_params = sampling_params
        self.seed = seed
        self.block_ids = list(block_ids)
        self.block_hashes: list[BlockHash] = []
        self.num_window_released = 0
        """Leading blocks whose window slots the request let go (or never held)."""
        self.num_computed_tokens = num_computed_tokens
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.eos_token_ids = frozenset(eos_token_ids)
        if not 0 <= num_computed_tokens < self.num_tokens:
            raise ValueError(
                f"request {request_id!r}: num_computed_tokens must be in [0, {self.num_tokens})"
            )

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (including those generated before a resume)."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """Whether the request has reached a terminal status."""
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the request finished, ``None`` while it is still live."""
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        """Records a sampled token; its KV is computed by the next step."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The terminal status reached after the latest token, or ``None`` to keep going."""
        reason = check_stop(
            self.token_ids[-1],
            self.num_output_tokens,
            self.sampling_params,
            self.eos_token_ids,
            num_tokens=self.num_tokens,
            max_model_len=max_model_len,
        )
        return None if reason is None else _FINISHED_STATUSES[reason]

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
