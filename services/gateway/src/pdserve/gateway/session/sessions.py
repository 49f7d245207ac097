"""The one entry point of every request: `Sessions` opens it (plain, resumable or background,
whichever API took it), and finds, resumes, reads, cancels and deletes a kept one.

A front end parses its body into the gateway's terms, prepares it, opens a session and writes
the session's deltas in its wire format; to resume, it names the request and says how to
parse a stored body again, and gets the same kind of session back. Each front end also tells
`Sessions` how to parse its stored bodies (`parse_stored_with`), so that a running request whose
gateway died is adopted here (`adopt_orphans`) with no client asking, whichever API took it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason
from pdserve.gateway.access.auth import Caller
from pdserve.gateway.choices import merged
from pdserve.gateway.fleet.backend import Backend, BackendError
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.output_deltas import replay
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import ApiKind, GenerationEnd, OutputDelta, ResponseStatus
from pdserve.gateway.session.access import (
    Lookup,
    collected,
    find,
    replay_end,
    stored_error,
)
from pdserve.gateway.session.run import Run
from pdserve.gateway.session.runs import Runs
from pdserve.gateway.session.session import (
    Parsed,
    Session,
    SessionMode,
    Snapshot,
    followed,
    raw_body,
    replayed,
    stored_body,
)
from pdserve.gateway.session.store import ResumeRecord, StoredEnd
from pdserve.gateway.streaming import Streamer

log = structlog.get_logger("pdserve.gateway.session")

DECODE_TIMEOUT_S = 5.0
# NOTE: how long a stored response's end waits for the store before it is answered anyway.
STORED_END_WAIT_S = 1.0

ParseStored = Callable[[bytes], Awaitable[Parsed]]
"""Parses a stored body again (the front end's parser)."""


@dataclass(eq=False)
class Sessions:
    """Opens and finds the requests of every front end.

    Args:
        streamer: Runs prepared requests.
        frontend: Prepares a stored request again (the same prompt, the same seed).
        runs: This gateway's kept requests and the store; None: only plain requests.
        backend: Reads a running request's tokens from its decode and releases the lease of
            one cancelled through the store (needed with `runs`).
        now: Wall clock.
    """

    streamer: Streamer
    frontend: Frontend
    runs: Runs | None = None
    backend: Backend | None = None
    now: Callable[[], float] = time.time
    _parsers: dict[ApiKind, ParseStored] = field(default_factory=dict, init=False, repr=False)

    def parse_stored_with(self, kind: ApiKind, parse: ParseStored) -> None:
        """How the front end of `kind` parses its stored bodies (for `adopt_orphans`)."""
        self._parsers[kind] = parse

    @property
    def can_keep(self) -> bool:
        """Whether requests can be resumable, stored or run in the background here."""
        return self.runs is not None

    async def open(
        self,
        kind: ApiKind,
        prompts: Sequence[PreparedRequest],
        caller: Caller,
        mode: SessionMode = SessionMode.PLAIN,
        raw: bytes = b"",
        body: object | None = None,
    ) -> Session:
        """Opens a new request: a plain one runs as its deltas are read (each choice through
        the streamer, merged); a stored one too, its record written as it ends; a kept one
        starts running here at once, its record written first.

        Args:
            kind: The API that took it.
            prompts: Its prepared requests (a kept request has one, with one choice).
            caller: Who sent it (a kept request's owner).
            mode: How it runs.
            raw: Its body as sent (kept in the record of a kept or stored request).
            body: Its body as parsed (a kept request keeps it for its followers here).

        Raises:
            PdserveError: RATE_LIMITED when the store holds its most requests,
                PEER_UNAVAILABLE when it cannot be reached.
        """
        if mode is SessionMode.PLAIN:
            choices = [choice for prompt in prompts for choice in prompt.choices()]
            n = prompts[0].n

            def source() -> AsyncGenerator[tuple[int, OutputDelta], None]:
                return merged([self.streamer.stream(c, index=i) for i, c in enumerate(choices)], n)

            return Session(kind, prompts, source)
        runs = self._kept()
        (prompt,) = prompts
        if mode is SessionMode.STORED:
            return self._stored(runs, kind, prompt, caller, stored_body(kind, raw), body)
        run = await runs.begin(kind, stored_body(kind, raw), prompt, caller.api_key_name)
        run.parsed = body
        return followed(kind, run)

    async def resume(self, lookup: Lookup, parse: ParseStored) -> Session:
        """Reopens a kept request of the lookup's kinds, the same way for every front end: this
        gateway's run is followed; a stored one is prepared again and replayed if it ended,
        else taken over from its decode. Counted in ``resumes{how}`` and logged
        (``resumable_request_resumed``, with ``how``).

        Args:
            lookup: Which request, and who asks.
            parse: Parses its stored body (when this gateway does not hold it parsed).

        Raises:
            PdserveError: REQUEST_NOT_FOUND for an unknown, expired or other key's request;
                as `parse`, preparing it, or the take-over.
        """
        runs = self._kept()
        found = await self._find(lookup)
        resumes = runs.metrics.resumes
        if isinstance(found, Run):
            resumes.labels(how="local").inc()
            log.info("resumable_request_resumed", request_id=lookup.request_id, how="local")
            await self._keep_parsed(found, parse)
            return followed(found.record.kind, found)
        parsed, prepared = await self._prepare(found, parse, lookup.caller.api_key_name)
        if found.end is None:
            resumes.labels(how="takeover").inc()
            log.info("resumable_request_resumed", request_id=lookup.request_id, how="takeover")
            run = await runs.take_over(found, prepared)
            run.parsed = run.parsed or parsed.body
            return followed(found.kind, run)
        resumes.labels(how="stored").inc()
        log.info("resumable_request_resumed", request_id=lookup.request_id, how="stored")
        return replayed(found, prepared, parsed.body)

    async def snapshot(self, lookup: Lookup, parse: ParseStored) -> Snapshot:
        """A kept request as it stands: this gateway's run's deltas so far, an ended one's
        stored tokens, or a running one's tokens so far read from its decode (nothing is
        taken over). Arguments and errors as `resume`."""
        found = await self._find(lookup)
        if isinstance(found, Run):
            body = await self._keep_parsed(found, parse)
            status, error = found.status, found.error
            return Snapshot(found.record, found.prepared, body, list(found.deltas), status, error)
        parsed, prepared = await self._prepare(found, parse, lookup.caller.api_key_name)
        if found.end is not None:
            deltas = await collected(replay_end(prepared, found.end))
            error = stored_error(found.end)
            return Snapshot(found, prepared, parsed.body, deltas, found.end.status, error)
        token_ids = await self._tokens_so_far(found)
        end = GenerationEnd(FinishReason.STOP, len(token_ids))
        deltas = (await collected(replay(prepared, token_ids, end)))[:-1]
        status = ResponseStatus.IN_PROGRESS
        return Snapshot(found, prepared, parsed.body, deltas, status, None)

    async def record(self, lookup: Lookup) -> ResumeRecord:
        """A kept or stored request's record as last known here. Errors as `resume`."""
        found = await self._find(lookup)
        return found.record if isinstance(found, Run) else found

    async def cancel(self, lookup: Lookup) -> None:
        """Cancels a running kept request: this gateway's run is cancelled (its lease
        released); one running elsewhere gets a cancelled end in the store, and its lease
        is released through the decode. An ended one stays as it is. Errors as `resume`."""
        runs = self._kept()
        found = await self._find(lookup)
        if isinstance(found, Run):
            await runs.cancel(found)
            return
        if found.end is not None:
            return
        end = StoredEnd(
            status=ResponseStatus.CANCELLED,
            completed_at=self.now(),
            error_code=ErrorReason.CANCELLED.name.lower(),
            error_message="the response was cancelled",
        )
        await runs.put(replace(found, end=end), runs.keep_s)
        placement = found.placement
        request_id = found.request_id
        if placement is not None:
            assert self.backend is not None
            try:
                await self.backend.release_lease(
                    placement.decode_address, placement.lease_id, request_id, DECODE_TIMEOUT_S
                )
            except BackendError as failure:
                log.info("cancel_release_failed", request_id=request_id, error=str(failure))
        log.info("response_cancelled", request_id=request_id, is_held_here=False)

    async def delete(self, lookup: Lookup) -> None:
        """Forgets a kept request (cancelling it first if it runs here). Errors as `resume`."""
        runs = self._kept()
        found = await self._find(lookup)
        if isinstance(found, Run):
            await runs.cancel(found)
            runs.forget(found)
        await runs.store.delete(lookup.request_id)

    async def adopt_orphans(self) -> int:
        """Takes over every running request whose gateway is gone (`ResumeStore.orphans`):
        each is prepared again from its record and runs here to its end (attached to its
        decode where it was placed, else from its prompt), as a client's resume would; one
        that can no longer be prepared ends failed. Counted in ``resumes{how="adopted"}``.

        Returns:
            How many were adopted here.

        Raises:
            PdserveError: PEER_UNAVAILABLE when the store cannot be reached.
        """
        runs = self._kept()
        num_adopted = 0
        for record, revision in await runs.store.orphans():
            parse = self._parsers.get(record.kind)
            own = runs.get(record.request_id)
            if parse is None or (own is not None and not own.is_moved):
                continue  # NOTE: an API not served here, or running here already
            fields = {"request_id": record.request_id, "kind": record.kind.value}
            try:
                if not await runs.adopt(record, revision):
                    continue  # NOTE: another gateway was first
            except PdserveError as error:
                # NOTE: e.g. this gateway holds its most requests: another may adopt it.
                log.warning("orphan_not_adopted", **fields, reason=error.reason.name)
                continue
            try:
                parsed, prepared = await self._prepare(record, parse, record.owner)
            except PdserveError as error:
                log.warning("orphan_not_adopted", **fields, reason=error.reason.name)
                await runs.fail_stored(record, error)
                continue
            run = await runs.take_over(record, prepared)
            run.parsed = parsed.body
            runs.metrics.resumes.labels(how="adopted").inc()
            log.info(
                "resumable_request_adopted",
                **fields,
                gone_gateway=record.holder,
                is_placed=record.placement is not None,
            )
            num_adopted += 1
        return num_adopted

    async def keep_adopting(self, interval_s: float) -> None:
        """`adopt_orphans` every `interval_s` until cancelled; an unreachable store is
        logged once per outage."""
        is_failing = False
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.adopt_orphans()
            except PdserveError as error:
                if not is_failing:
                    log.warning("orphan_adoption_failed", reason=error.message)
                is_failing = True
            except Exception:  # NOTE: the loop outlives a bug in one pass; the log says it
                log.exception("orphan_adoption_failed")
            else:
                is_failing = False

    # ---- helpers ----------------------------------------------------------------------------

    def _stored(
        self,
        runs: Runs,
        kind: ApiKind,
        prompt: PreparedRequest,
        caller: Caller,
        body_text: str,
        body: object | None,
    ) -> Session:
        """A plain request whose end is written to the store before its final delta is
        given (a client that has the end finds it stored); one that failed is stored failed,
        one its client left is not stored. A store that cannot write it is logged
        (``response_not_stored``), and one that has not answered within `STORED_END_WAIT_S`
        (``response_store_slow``) writes it after: the request is answered all the same."""
        record = runs.record_of(kind, body_text, prompt, caller.api_key_name)

        async def write(deltas: list[OutputDelta], error: PdserveError | None) -> ResumeRecord:
            try:
                return await runs.keep_end(record, deltas, error)
            except PdserveError as failure:
                log.warning(
                    "response_not_stored", request_id=record.request_id, reason=failure.message
                )
                return record

        async def keep(deltas: list[OutputDelta], error: PdserveError | None = None) -> None:
            writing = runs.track(write(deltas, error))
            try:
                session.record = await asyncio.wait_for(asyncio.shield(writing), STORED_END_WAIT_S)
            except TimeoutError:
                log.warning("response_store_slow", request_id=record.request_id)

        async def source() -> AsyncGenerator[tuple[int, OutputDelta], None]:
            deltas: list[OutputDelta] = []
            stream = self.streamer.stream(prompt)
            try:
                async with contextlib.aclosing(stream):
                    async for index, delta in stream:
                        deltas.append(delta)
                        if delta.finish_reason is not None:
                            await keep(deltas)
                        yield index, delta
            except PdserveError as error:
                await keep(deltas, error)
                raise

        session = Session(kind, [prompt], source, record=record, body=body)
        return session

    def _kept(self) -> Runs:
        if self.runs is None:
            raise PdserveError(
                ErrorReason.INVALID_REQUEST, "resumable requests are not enabled on this gateway"
            )
        return self.runs

    async def _find(self, lookup: Lookup) -> Run | ResumeRecord:
        found = await find(self._kept(), lookup)
        if found is None:
            raise lookup.not_found()
        return found

    async def _keep_parsed(self, run: Run, parse: ParseStored) -> object:
        """A run's parsed body (parsed again only where the run did not keep it)."""
        if run.parsed is None:
            run.parsed = (await parse(raw_body(run.record))).body
        return run.parsed

    async def _prepare(
        self, record: ResumeRecord, parse: ParseStored, key_name: str | None
    ) -> tuple[Parsed, PreparedRequest]:
        """A stored request prepared again: the same prompt, the same seed, the same id
        (`key_name`: the API key asking, for its limits and logs)."""
        parsed = await parse(raw_body(record))
        params = replace(parsed.params, seed=record.seed)
        prepared = await self.frontend.prepare(params, record.request_id, key_name)
        return parsed, prepared

    async def _tokens_so_far(self, record: ResumeRecord) -> tuple[int, ...]:
        """A running request's tokens, read from its decode (none when it cannot be read)."""
        placement = record.placement
        if placement is None:
            return ()
        assert self.backend is not None
        try:
            snapshot = await self.backend.snapshot(
                placement.decode_address, record.request_id, placement.lease_id, DECODE_TIMEOUT_S
            )
        except BackendError as failure:
            log.info("snapshot_failed", request_id=record.request_id, error=str(failure))
            return ()
        return snapshot.token_ids
