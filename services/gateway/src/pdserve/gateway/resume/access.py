"""What the resumable front ends share: finding a request for its owner, reopening it (follow
this gateway's run, replay an ended one from its stored tokens, or take over one another
gateway left running), and preparing a stored request again."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, replace

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason
from pdserve.gateway.access.auth import Caller
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.output_deltas import replay
from pdserve.gateway.prepare.params import GenerationParams, PreparedRequest
from pdserve.gateway.request import ApiKind, GenerationEnd, OutputDelta
from pdserve.gateway.resume.run import Run
from pdserve.gateway.resume.runs import Runs
from pdserve.gateway.resume.store import ResumeRecord, StoredEnd


async def find(
    runs: Runs, request_id: str, kinds: tuple[ApiKind, ...], caller: Caller
) -> Run | ResumeRecord | None:
    """This gateway's run of `request_id` (unless another gateway took it over), else its
    stored record; None when there is none of `kinds`, it expired, or `caller` is not its
    owner (to whom it does not exist)."""
    found: Run | ResumeRecord | None = runs.get(request_id)
    if isinstance(found, Run) and found.is_moved:
        found = None  # NOTE: another gateway took it over: what the store says is current
    if isinstance(found, Run) and found.is_done:
        stored = await runs.store.get(request_id)
        if stored is None:
            return None  # NOTE: deleted (through any gateway) or expired
        if stored.end is not None:
            found.record = stored  # NOTE: an end written through another gateway (a cancel) wins
    if found is None:
        found = await runs.store.get(request_id)
    if found is None:
        return None
    record = found.record if isinstance(found, Run) else found
    if record.kind not in kinds or not may_access(record, caller):
        return None
    return found


@dataclass(frozen=True)
class Reopened:
    """A found request, ready to be followed.

    Attributes:
        record: Its record.
        prepared: Its prepared request.
        run: This gateway's run of it (its own, or just taken over); None for a request that
            ended, whose deltas come from the store.
    """

    record: ResumeRecord
    prepared: PreparedRequest
    run: Run | None

    def deltas(self) -> AsyncGenerator[OutputDelta, None]:
        """Every delta from the first: the run's (live), or the stored end's."""
        if self.run is not None:
            return self.run.follow()
        assert self.record.end is not None
        return replay_end(self.prepared, self.record.end)


async def reopen(
    runs: Runs,
    found: Run | ResumeRecord,
    prepare: Callable[[ResumeRecord], Awaitable[PreparedRequest]],
) -> Reopened:
    """Reopens what `find` found, the same way for every front end: this gateway's run is
    followed; a stored request is prepared again (`prepare`) and replayed if it ended, else
    taken over from its decode. Counted in ``resumes{how}``.

    Raises:
        PdserveError: As `prepare`, or the take-over.
    """
    resumes = runs.metrics.resumes
    if isinstance(found, Run):
        resumes.labels(how="local").inc()
        return Reopened(found.record, found.prepared, found)
    prepared = await prepare(found)
    if found.end is not None:
        resumes.labels(how="stored").inc()
        return Reopened(found, prepared, None)
    resumes.labels(how="takeover").inc()
    return Reopened(found, prepared, await runs.take_over(found, prepared))


def may_access(record: ResumeRecord, caller: Caller) -> bool:
    """Only the creator's key (anyone, on a gateway that was open when it was created)."""
    return record.owner is None or record.owner == caller.api_key_name


async def prepare_again(
    frontend: Frontend, params: GenerationParams, record: ResumeRecord, caller: Caller
) -> PreparedRequest:
    """A stored request prepared again: the same prompt, the same seed, the same id."""
    params = replace(params, seed=record.seed)
    return await frontend.prepare(params, record.request_id, caller.api_key_name)


def stored_error(end: StoredEnd) -> PdserveError | None:
    """The error a stored end records (None: it finished)."""
    if end.error_code is None:
        return None
    try:
        reason = ErrorReason[end.error_code.upper()]
    except KeyError:
        reason = ErrorReason.INTERNAL
    return PdserveError(reason, end.error_message or "")


def replay_end(prompt: PreparedRequest, end: StoredEnd) -> AsyncGenerator[OutputDelta, None]:
    """An ended request's deltas from its stored tokens; one that failed or was cancelled
    has no final delta and raises its error after the others."""
    reason = FinishReason(end.finish_reason) if end.finish_reason else FinishReason.STOP
    generation_end = GenerationEnd(reason, len(end.token_ids), end.num_cached_prompt_tokens)
    deltas = replay(prompt, end.token_ids, generation_end)
    if end.finish_reason is not None:
        return deltas
    return _without_final(deltas, stored_error(end))


async def _without_final(
    deltas: AsyncGenerator[OutputDelta, None], error: PdserveError | None
) -> AsyncGenerator[OutputDelta, None]:
    async for delta in deltas:
        if delta.finish_reason is None:
            yield delta
    if error is not None:
        raise error
