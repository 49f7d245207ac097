"""What the resumable front ends share: finding a request for its owner, preparing a stored
request again, and the deltas of one that ended, made again from its stored tokens."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import replace

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
