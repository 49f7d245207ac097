"""Background responses: created, polled, streamed from any point, cancelled and deleted, on
any gateway that shares the store of resumable requests.

``POST /v1/responses`` with ``background: true`` answers at once (``queued``; streamed: its
events as they come) while the response runs in this gateway (`pdserve.gateway.resume.runs`).
``GET /v1/responses/{id}`` answers the response as it stands; with ``stream=true`` its events
from ``starting_after`` + 1 on, live until the end. Every event is a function of the
response's tokens (one delta per token), so a gateway that never saw the response makes the
same events again and sends only the ones after ``starting_after``:

* a response this gateway holds: its deltas so far;
* one that ended: its tokens from the store;
* one still running that another gateway holds or held: a stream is taken over (the decode
  replays its tokens to this gateway, which holds it from then on); a plain ``GET`` reads the
  tokens so far from the decode without taking anything over.

Only the API key that created a response reads, streams, cancels or deletes it; to any other
key (and for unknown or expired ids) it does not exist (404).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import Any

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import FinishReason
from pdserve.gateway.access.auth import Caller
from pdserve.gateway.fleet.backend import Backend, BackendError
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.openai.responses_api.convert import ResponsesBody, parse_responses_body
from pdserve.gateway.openai.responses_api.snapshots import (
    collected,
    events_after,
    indexed,
    response_snapshot,
    writer_of,
)
from pdserve.gateway.openai.responses_api.writer import ResponseWriter, request_id_of
from pdserve.gateway.output_deltas import replay
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.prepare.workers import ParserPool
from pdserve.gateway.request import ApiKind, GenerationEnd, ResponseStatus
from pdserve.gateway.resume.access import find, prepare_again, reopen, replay_end, stored_error
from pdserve.gateway.resume.run import Run
from pdserve.gateway.resume.runs import Runs
from pdserve.gateway.resume.store import ResumeRecord, StoredEnd

log = structlog.get_logger("pdserve.gateway.openai.background")

KIND = ApiKind.RESPONSES
SNAPSHOT_TIMEOUT_S = 5.0


def not_found(response_id: str) -> PdserveError:
    """The 404 of an unknown, expired or someone else's response."""
    return PdserveError(
        ErrorReason.REQUEST_NOT_FOUND,
        f"no response with id {response_id[:200]!r} (unknown, expired or another key's)",
    )


class BackgroundResponses:
    """Background responses over this gateway's runs and the shared store.

    Args:
        runs: This gateway's resumable requests (and the store).
        frontend: Prepares a stored request again (same prompt, same seed).
        parser: Parses a stored body.
        backend: Reads a running response's tokens from its decode; releases a cancelled
            response's lease.
        now: Wall clock.
    """

    def __init__(
        self,
        runs: Runs,
        frontend: Frontend,
        parser: ParserPool,
        backend: Backend,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._runs = runs
        self._frontend = frontend
        self._parser = parser
        self._backend = backend
        self._now = now

    # ---- create -----------------------------------------------------------------------------

    async def create(
        self, raw: bytes, body: ResponsesBody, prompt: PreparedRequest, caller: Caller
    ) -> Run:
        """Starts a background response (its record written first).

        Raises:
            PdserveError: RATE_LIMITED when the store holds its most responses,
                PEER_UNAVAILABLE when it cannot be reached.
        """
        run = await self._runs.begin(KIND, raw.decode(), prompt, caller.api_key_name)
        run.parsed = body
        return run

    def writer(self, run: Run, body: ResponsesBody) -> ResponseWriter:
        """The writer of a run's response."""
        return writer_of(run.prepared, body, run.record)

    def queued(self, run: Run, body: ResponsesBody) -> dict[str, Any]:
        """The answer to a non-streamed create: the response, queued."""
        return self.writer(run, body).response(ResponseStatus.QUEUED)

    # ---- read ---------------------------------------------------------------------------------

    async def retrieve(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """The response as it stands (its output so far while it runs)."""
        found = await self._find(response_id, caller)
        if isinstance(found, Run):
            body = await self._body_of(found)
            return response_snapshot(
                self.writer(found, body), found.deltas, found.status, found.error
            )
        record = found
        body, prompt = await self._prepare(record, caller)
        writer = writer_of(prompt, body, record)
        if record.end is not None:
            deltas = await collected(replay_end(prompt, record.end))
            return response_snapshot(writer, deltas, record.end.status, stored_error(record.end))
        token_ids = await self._tokens_so_far(record)
        end = GenerationEnd(FinishReason.STOP, len(token_ids))
        deltas = (await collected(replay(prompt, token_ids, end)))[:-1]
        return response_snapshot(writer, deltas, ResponseStatus.IN_PROGRESS, None)

    async def stream(
        self, response_id: str, caller: Caller, starting_after: int | None
    ) -> AsyncGenerator[str, None]:
        """The response's events after sequence number `starting_after` (all: None), live
        until it ends; a running response another gateway held is taken over."""
        found = await self._find(response_id, caller)
        parsed: list[ResponsesBody] = []  # NOTE: the body of a stored one, parsed to prepare it

        async def prepare(record: ResumeRecord) -> PreparedRequest:
            body, prompt = await self._prepare(record, caller)
            parsed.append(body)
            return prompt

        reopened = await reopen(self._runs, found, prepare)
        run = reopened.run
        if run is None:
            writer = writer_of(reopened.prepared, parsed[0], reopened.record)
            deltas = indexed(reopened.deltas())
            return events_after(writer.events(None, deltas), starting_after)
        if parsed:
            run.parsed = run.parsed or parsed[0]
        return self.events(run, await self._body_of(run), starting_after)

    def events(
        self, run: Run, body: ResponsesBody, starting_after: int | None = None
    ) -> AsyncGenerator[str, None]:
        """A run's events after sequence number `starting_after`, live."""
        writer = self.writer(run, body)
        return events_after(writer.events(None, indexed(run.follow())), starting_after)

    # ---- cancel, delete ----------------------------------------------------------------------

    async def cancel(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """Cancels a running response (its lease is released); an ended one stays as it is."""
        found = await self._find(response_id, caller)
        if isinstance(found, Run):
            await self._runs.cancel(found)
            return await self.retrieve(response_id, caller)
        record = found
        if record.end is None:
            end = StoredEnd(
                status=ResponseStatus.CANCELLED,
                completed_at=self._now(),
                error_code=ErrorReason.CANCELLED.name.lower(),
                error_message="the response was cancelled",
            )
            await self._runs.put(_with_end(record, end), self._runs.keep_s)
            placement = record.placement
            if placement is not None:
                try:
                    await self._backend.release_lease(
                        placement.decode_address,
                        placement.lease_id,
                        record.request_id,
                        SNAPSHOT_TIMEOUT_S,
                    )
                except BackendError as failure:
                    log.info(
                        "cancel_release_failed", request_id=record.request_id, error=str(failure)
                    )
            log.info("response_cancelled", request_id=record.request_id, is_held_here=False)
        return await self.retrieve(response_id, caller)

    async def delete(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """Forgets a response (cancelling it first if it runs here)."""
        found = await self._find(response_id, caller)
        request_id = found.request_id
        if isinstance(found, Run):
            await self._runs.cancel(found)
            self._runs.forget(found)
        await self._runs.store.delete(request_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # ---- helpers ------------------------------------------------------------------------------

    async def _find(self, response_id: str, caller: Caller) -> Run | ResumeRecord:
        """This gateway's run of the response, else its stored record; 404 for an unknown,
        expired or other key's response."""
        request_id = request_id_of(response_id)
        found = None if request_id is None else await find(self._runs, request_id, (KIND,), caller)
        if found is None:
            raise not_found(response_id)
        return found

    async def _body_of(self, run: Run) -> ResponsesBody:
        """A run's parsed body (parsed again only where the run did not keep it)."""
        if isinstance(run.parsed, ResponsesBody):
            return run.parsed
        body = await self._parse(run.record)
        run.parsed = body
        return body

    async def _parse(self, record: ResumeRecord) -> ResponsesBody:
        raw = record.body.encode()
        limits = self._frontend.limits
        return await self._parser.run(parse_responses_body, len(raw), raw, limits)

    async def _prepare(
        self, record: ResumeRecord, caller: Caller
    ) -> tuple[ResponsesBody, PreparedRequest]:
        """The stored request prepared again: the same prompt, the same seed, the same id."""
        body = await self._parse(record)
        return body, await prepare_again(self._frontend, body.params, record, caller)

    async def _tokens_so_far(self, record: ResumeRecord) -> tuple[int, ...]:
        """A running response's tokens, read from its decode (none when it cannot be read)."""
        placement = record.placement
        if placement is None:
            return ()
        try:
            snapshot = await self._backend.snapshot(
                placement.decode_address,
                record.request_id,
                placement.lease_id,
                SNAPSHOT_TIMEOUT_S,
            )
        except BackendError as failure:
            log.info("snapshot_failed", request_id=record.request_id, error=str(failure))
            return ()
        return snapshot.token_ids


def _with_end(record: ResumeRecord, end: StoredEnd) -> ResumeRecord:
    return replace(record, end=end)
