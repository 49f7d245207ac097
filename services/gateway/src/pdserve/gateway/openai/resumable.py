"""Resumable chat and completions streams (``stream_options: {"resumable": true}``).

Such a stream runs in this gateway as a resumable request (`pdserve.gateway.resume.runs`): a
client that goes away only stops following it, and a gateway that dies leaves it running on
its decode. Every server-sent event carries ``id: N``, N being the completion tokens sent so
far (its own included). A client resumes on any gateway sharing the store with

    GET /v1/chat/completions/{id}/stream?starting_after=N   (or /v1/completions/...)

(``{id}`` is the ``X-Request-Id`` header, or the chunks' ``id`` with its ``chatcmpl-`` /
``cmpl-`` prefix; a ``Last-Event-ID: N`` header does as ``starting_after``), and gets every
event holding tokens after the N-th, then the end: the same chunks, token for token and text
for text, as the stream it left. Without ``starting_after`` it gets the whole stream again; past
the end, the end. Only the key that created a stream may resume it; to others it does not
exist (404).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

import structlog

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.access.auth import Caller
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.openai.http import error_body
from pdserve.gateway.openai.parsing import OpenAIBody, parse_openai_body
from pdserve.gateway.openai.responses import Responder
from pdserve.gateway.openai.sse import sse
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.prepare.validation import invalid
from pdserve.gateway.prepare.workers import ParserPool
from pdserve.gateway.request import ApiKind, OutputDelta
from pdserve.gateway.resume.access import find, prepare_again, reopen
from pdserve.gateway.resume.run import Run, RunMoved
from pdserve.gateway.resume.runs import Runs
from pdserve.gateway.resume.store import ResumeRecord

log = structlog.get_logger("pdserve.gateway.openai.resumable")

PREFIXES = ("chatcmpl-", "cmpl-")


class ResumableStreams:
    """Starts and resumes resumable chat and completions streams.

    Args:
        runs: This gateway's resumable requests (and the store).
        frontend: Prepares a stored request again (same prompt, same seed).
        parser: Parses a stored body.
    """

    def __init__(self, runs: Runs, frontend: Frontend, parser: ParserPool) -> None:
        self._runs = runs
        self._frontend = frontend
        self._parser = parser

    async def start(
        self, raw: bytes, kind: ApiKind, prompt: PreparedRequest, caller: Caller
    ) -> Run:
        """Starts a resumable stream (its record written first).

        Raises:
            PdserveError: RATE_LIMITED when the store holds its most requests,
                PEER_UNAVAILABLE when it cannot be reached.
        """
        return await self._runs.begin(kind, raw.decode(), prompt, caller.api_key_name)

    async def resume(
        self, stream_id: str, kind: ApiKind, caller: Caller, starting_after: int | None
    ) -> AsyncGenerator[str, None]:
        """The events of a stream after its `starting_after`-th token (all: None), live; a
        running stream another gateway held is taken over.

        Raises:
            PdserveError: REQUEST_NOT_FOUND (404) for an unknown, expired or other key's
                stream.
        """
        request_id = _request_id(stream_id)
        found = await find(self._runs, request_id, (kind,), caller)
        if found is None:
            raise PdserveError(
                ErrorReason.REQUEST_NOT_FOUND,
                f"no resumable stream with id {stream_id[:200]!r} (unknown, expired or another "
                "key's)",
            )
        record = found.record if isinstance(found, Run) else found
        body = await self._parse(record, kind)

        async def prepare(stored: ResumeRecord) -> PreparedRequest:
            return await prepare_again(self._frontend, body.params[0], stored, caller)

        reopened = await reopen(self._runs, found, prepare)
        responder = _responder(kind, reopened.prepared, body, record)
        return events(responder, reopened.deltas(), starting_after)

    async def _parse(self, record: ResumeRecord, kind: ApiKind) -> OpenAIBody:
        raw = record.body.encode()
        limits = self._frontend.limits
        is_chat = kind == ApiKind.CHAT
        return await self._parser.run(parse_openai_body, len(raw), raw, is_chat, limits)


def responder_for(kind: ApiKind, prompt: PreparedRequest, body: OpenAIBody, run: Run) -> Responder:
    """The responder of a resumable stream that starts here."""
    return _responder(kind, prompt, body, run.record)


def _responder(
    kind: ApiKind, prompt: PreparedRequest, body: OpenAIBody, record: ResumeRecord
) -> Responder:
    responder = Responder(kind, [prompt], body)
    responder.created = int(record.created_at)
    return responder


def _request_id(stream_id: str) -> str:
    for prefix in PREFIXES:
        if stream_id.startswith(prefix):
            return stream_id.removeprefix(prefix)
    return stream_id


async def events(
    responder: Responder, deltas: AsyncGenerator[OutputDelta, None], starting_after: int | None
) -> AsyncGenerator[str, None]:
    """The SSE events of a resumable stream, each with ``id: <tokens sent>``, after its
    `starting_after`-th token; ends quietly where another gateway took the stream over."""
    num_tokens = 0
    is_first = True
    last: list[str] = []
    sent = False
    try:
        async for delta in deltas:
            num_before = num_tokens
            num_tokens += len(delta.token_ids)
            rendered = responder.render(0, delta, is_first)
            if rendered:
                is_first = False
            if _is_new(num_before, num_tokens, starting_after):
                for event in rendered:
                    sent = True
                    yield f"id: {num_tokens}\n{event}"
            elif rendered:
                last = [f"id: {num_tokens}\n{event}" for event in rendered]
    except RunMoved:
        return
    except PdserveError as error:
        message = error.message or error.reason.name
        yield sse(error_body(message, error.http_status, error.reason.name.lower()))
    finally:
        await deltas.aclose()
    if not sent:
        for event in last:  # NOTE: past the end: the end
            yield event
    yield f"id: {num_tokens}\n" + sse("[DONE]")


def _is_new(num_before: int, num_after: int, starting_after: int | None) -> bool:
    """Whether an event (tokens `num_before` to `num_after`) is after the client's place: it
    holds a later token, or holds none and comes after the last token the client has."""
    if starting_after is None:
        return True
    if num_after > num_before:
        return num_after > starting_after
    return num_before > starting_after or (num_before == starting_after and num_before > 0)


def position_of(values: Sequence[str | None]) -> int | None:
    """The first of `values` given (e.g. ``starting_after``, then ``Last-Event-ID``) as a
    non-negative integer (a token count or a sequence number); None when none is.

    Raises:
        PdserveError: INVALID_REQUEST (``starting_after``) for anything else.
    """
    for value in values:
        if value is None:
            continue
        try:
            number = int(value)
        except ValueError:
            number = -1
        if number < 0:
            raise invalid("starting_after must be a non-negative integer", "starting_after")
        return number
    return None
