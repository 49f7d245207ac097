"""A kept request as this gateway finds it: this gateway's run of it or its stored record,
for its owner alone; and an ended request's deltas made again from its stored end."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import NamedTuple

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason
from pdserve.gateway.access.auth import Caller
from pdserve.gateway.output_deltas import replay
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import ApiKind, GenerationEnd, OutputDelta
from pdserve.gateway.session.run import Run
from pdserve.gateway.session.runs import Runs
from pdserve.gateway.session.store import ResumeRecord, StoredEnd

_NOUNS = {
    ApiKind.RESPONSES: "response",
    ApiKind.CHAT: "resumable stream",
    ApiKind.COMPLETIONS: "resumable stream",
    ApiKind.GRPC: "resumable request",
}


class Lookup(NamedTuple):
    """A kept or stored request as a client names it, and who asks.

    Attributes:
        request_id: The gateway's id of it.
        kinds: The APIs it may have come through.
        caller: Who asks (only its owner finds it).
        shown_id: Its id as the client gave it (for the 404); None: `request_id`.
    """

    request_id: str
    kinds: tuple[ApiKind, ...]
    caller: Caller
    shown_id: str | None = None

    def not_found(self) -> PdserveError:
        """The 404 of this lookup."""
        return not_found(self.kinds[0], self.shown_id or self.request_id)


def not_found(kind: ApiKind, shown_id: str) -> PdserveError:
    """The 404 (REQUEST_NOT_FOUND) of an unknown, expired or someone else's request.

    Args:
        kind: The API asked (names what was not found).
        shown_id: The id as the client gave it.
    """
    shown_id = shown_id[:200]
    return PdserveError(
        ErrorReason.REQUEST_NOT_FOUND,
        f"no {_NOUNS[kind]} with id {shown_id!r} (unknown, expired or another key's)",
        {"requestId": shown_id},
    )


async def find(runs: Runs, lookup: Lookup) -> Run | ResumeRecord | None:
    """This gateway's run of the request (unless another gateway took it over), else its
    stored record; None when there is none of the lookup's kinds, it expired, or its caller is
    not its owner (to whom it does not exist)."""
    request_id = lookup.request_id
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
    if record.kind not in lookup.kinds or not may_access(record, lookup.caller):
        return None
    return found


def may_access(record: ResumeRecord, caller: Caller) -> bool:
    """Only the creator's key (anyone, on a gateway that was open when it was created)."""
    return record.owner is None or record.owner == caller.api_key_name


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


async def collected(deltas: AsyncGenerator[OutputDelta, None]) -> list[OutputDelta]:
    """The deltas of `deltas` up to its end or its error (which the caller has already)."""
    kept = []
    try:
        async for delta in deltas:
            kept.append(delta)
    except PdserveError:
        pass  # NOTE: a stored end's error, which its snapshot reports with the deltas before it
    return kept


async def _without_final(
    deltas: AsyncGenerator[OutputDelta, None], error: PdserveError | None
) -> AsyncGenerator[OutputDelta, None]:
    async for delta in deltas:
        if delta.finish_reason is None:
            yield delta
    if error is not None:
        raise error
