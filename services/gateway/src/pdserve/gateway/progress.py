"""A request's progress across its attempts: the tokens it delivered, kept exact by completion
index (`CompletionProgress`), and its bookkeeping of attempts, exclusions and reschedules
(`RequestState`).

Every token from a prefill or decode carries its completion index. `CompletionProgress`
appends a token only at the next index, drops tokens it already delivered (a retried attempt
resends them), reports a gap (a token index past the next one), and stops accepting once the
completion is over: a stop token or end-of-sequence id, or ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import structlog

from pdserve.common.errors import PdserveError
from pdserve.common.generation import FinishReason, TokenLogprobs, check_stop
from pdserve.gateway.request import GenerationRequest, TokenChunk

log = structlog.get_logger("pdserve.gateway.progress")


class Accepted(NamedTuple):
    """What one batch of indexed tokens added.

    Attributes:
        chunk: The tokens new to the consumer, or None when there are none.
        has_gap: A token's index was beyond the next one: tokens are missing, so the rest of
            the batch was not accepted.
    """

    chunk: TokenChunk | None
    has_gap: bool = False


class CompletionProgress:
    """The completion tokens of one request delivered so far.

    Args:
        request: The request (its prompt, max_tokens and stop ids).
    """

    def __init__(self, request: GenerationRequest) -> None:
        self._request = request
        self._token_ids: list[int] = []
        self._finish_reason: FinishReason | None = None
        self._num_mismatches = 0

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every completion token delivered, in order."""
        return tuple(self._token_ids)

    @property
    def num_tokens(self) -> int:
        """Completion tokens delivered (the next token's completion index)."""
        return len(self._token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still allowed by max_tokens."""
        return max(0, self._request.sampling.max_tokens - len(self._token_ids))

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the completion is over by the gateway's own count, or None while it is not."""
        return self._finish_reason

    @property
    def num_mismatches(self) -> int:
        """Resent tokens that differed from what was delivered at the same index."""
        return self._num_mismatches

    def continuation_token_ids(self) -> tuple[int, ...]:
        """Prompt plus delivered tokens: what a rescheduled attempt prefills."""
        return (*self._request.prompt_token_ids, *self._token_ids)

    def accept(
        self,
        token_ids: Sequence[int],
        first_index: int,
        logprobs: Sequence[TokenLogprobs] = (),
        prompt_logprobs: Sequence[TokenLogprobs] = (),
    ) -> Accepted:
        """Adds indexed tokens; returns those new to the consumer.

        Args:
            token_ids: Consecutive tokens.
            first_index: Completion index of ``token_ids[0]``.
            logprobs: One entry per token, when the request asks for logprobs.
            prompt_logprobs: The prompt's logprobs (a first attempt's first token only); they
                travel with the chunk when its first token is new.
        """
        new: list[int] = []
        new_logprobs: list[TokenLogprobs] = []
        start = len(self._token_ids)
        for offset, token_id in enumerate(token_ids):
            if self._finish_reason is not None:
                break
            index = first_index + offset
            if index < len(self._token_ids):
                if self._token_ids[index] != token_id:
                    # NOTE: the client already has the delivered token; keep it and log.
                    self._num_mismatches += 1
                    log.warning(
                        "resent_token_mismatch",
                        request_id=self._request.request_id,
                        index=index,
                        delivered_token_id=self._token_ids[index],
                        resent_token_id=token_id,
                    )
                continue
            if index > len(self._token_ids):
                chunk = TokenChunk(tuple(new), start, tuple(new_logprobs)) if new else None
                return Accepted(chunk, has_gap=True)
            self._token_ids.append(token_id)
            new.append(token_id)
            if offset < len(logprobs):
                new_logprobs.append(logprobs[offset])
            self._finish_reason = check_stop(
                token_id, len(self._token_ids), self._request.sampling, self._request.eos_token_ids
            )
        if not new:
            return Accepted(None)
        scored = tuple(prompt_logprobs) if start == 0 else ()
        return Accepted(TokenChunk(tuple(new), start, tuple(new_logprobs), scored))


_NO_IDS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RequestState:
    """Bookkeeping of one request across its attempts.

    Excluded instances are a requirement: routing never picks them again for this request.
    Avoided ones are a preference, relaxed when no other instance is available.
    """

    excluded_prefill_ids: frozenset[str] = _NO_IDS
    excluded_decode_ids: frozenset[str] = _NO_IDS
    avoided_prefill_ids: frozenset[str] = _NO_IDS
    avoided_decode_ids: frozenset[str] = _NO_IDS
    num_attempts: int = 0
    num_failures: int = 0
    num_reschedules: int = 0
    has_used_once_retry: bool = False
    last_error: PdserveError | None = None

    def exclusions(self) -> list[tuple[frozenset[str], frozenset[str]]]:
        """(prefill ids, decode ids) to exclude from routing, strictest first.

        The excluded instances are always left out; the avoided ones first together, then
        only the avoided decodes, then only the avoided prefills, then none of them.
        """
        avoided = [
            (self.avoided_prefill_ids, self.avoided_decode_ids),
            (_NO_IDS, self.avoided_decode_ids),
            (self.avoided_prefill_ids, _NO_IDS),
            (_NO_IDS, _NO_IDS),
        ]
        result: list[tuple[frozenset[str], frozenset[str]]] = []
        for prefill_ids, decode_ids in avoided:
            pair = (self.excluded_prefill_ids | prefill_ids, self.excluded_decode_ids | decode_ids)
            if pair not in result:
                result.append(pair)
        return result
