"""A forward pass's batch: the chunk of each sequence, as a scheduler hands it to the runner.

Every scheduler cuts its requests into the same `ScheduledChunk`: the prefill service's
(`pdserve.prefill.scheduler`), the decode service's loop (one token a request) and the
colocated reference engine's (`pdserve.engine.colocated`). `ModelRunner.execute` reads a
chunk's tokens, start position and block table; the scheduler reads back the request it was
cut from. A bare chunk (tests, benchmarks) has no request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Cuttable(Protocol):
    """A request a chunk can be cut from: its known tokens, its cached prefix, its blocks."""

    @property
    def token_ids(self) -> Sequence[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[int]: ...


class HasNumTokens(Protocol):
    """A request that knows how many tokens it has (prompt and output so far)."""

    @property
    def num_tokens(self) -> int: ...


R = TypeVar("R", covariant=True)
C = TypeVar("C", bound=Cuttable)


@dataclass(frozen=True)
class ScheduledChunk(Generic[R]):
    """One sequence's share of a forward pass.

    Attributes:
        token_ids: The new tokens to run (a prefill chunk, or the one last token of a decode).
        num_computed_tokens: Tokens of this sequence already in the cache; the first new token
            sits at this position.
        block_ids: The sequence's block table; it must cover
            ``num_computed_tokens + len(token_ids)`` tokens (extra trailing blocks are ignored).
        request: The request the chunk was cut from; None for a bare chunk.
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_ids: Sequence[int]
    request: R = None  # type: ignore[assignment]

    @staticmethod
    def cut(request: C, num_new_tokens: int) -> ScheduledChunk[C]:
        """The next `num_new_tokens` of `request`, from its first uncomputed token."""
        start = request.num_computed_tokens
        token_ids = request.token_ids[start : start + num_new_tokens]
        return ScheduledChunk(token_ids, start, request.block_ids, request)

    @property
    def num_new_tokens(self) -> int:
        """Tokens computed by this chunk."""
        return len(self.token_ids)

    @property
    def completes_prompt(self: ScheduledChunk[HasNumTokens]) -> bool:
        """Whether the chunk reaches the request's last known token, so its logits are sampled."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput(Generic[R]):
    """What one forward pass runs.

    Attributes:
        scheduled: The chunks in batch order (the scheduler's order: continuing requests first).
        num_batched_tokens: Total new tokens of the pass.
        preempted_request_ids: Requests preempted (blocks freed, back to waiting) to make room
            for this pass (the colocated scheduler's; the prefill never preempts).
    """

    scheduled: list[ScheduledChunk[R]] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Whether nothing runs in this pass."""
        return not self.scheduled
