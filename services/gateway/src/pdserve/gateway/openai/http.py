"""HTTP plumbing of the REST API: OpenAI error bodies, request bodies read within limits, request
ids, and the last-resort answer to an exception no handler took.

Every response carries ``X-Request-Id`` (the id of the generation request, in its logs and
spans). Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``
with the HTTP status of its reason, and keeps the connection open for the client's next
request: a body refused as too large (413) is answered at once and never buffered, and the
server discards the rest of it as it arrives. Only the answer to an unexpected exception (500)
says ``Connection: close``.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import structlog
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.common.errors import ErrorReason, PdserveError

log = structlog.get_logger("pdserve.gateway.openai.http")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_HTTP_ERROR_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    415: "unsupported_media_type",
}
REQUEST_ID_HEADER = "X-Request-Id"
CLOSE = {"Connection": "close"}
JSON_MEDIA_TYPE = "application/json"
MAX_CONTENT_LENGTH_DIGITS = 18


def error_body(message: str, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI error body."""
    error_type = _ERROR_TYPES.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: PdserveError) -> JSONResponse:
    """The HTTP response for a typed error (status from REASON_SPECS, Retry-After if known)."""
    status = error.http_status
    headers = {}
    if error.retry_delay_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_delay_s)))
    elif status == 429:
        headers["Retry-After"] = "1"
    body = error_body(
        error.message or error.reason.name,
        status,
        error.reason.name.lower(),
        error.metadata.get("param"),
    )
    return JSONResponse(body, status_code=status, headers=headers)


def http_error_response(error: StarletteHTTPException) -> JSONResponse:
    """The response for a routing-level HTTP error (404 unknown path, 405, 415)."""
    status = error.status_code
    code = _HTTP_ERROR_CODES.get(status, "http_error")
    return JSONResponse(
        error_body(str(error.detail), status, code), status_code=status, headers=error.headers
    )


def request_id_of(request: Request) -> str:
    """The id `RequestIdMiddleware` gave this request."""
    return str(request.scope["state"]["request_id"])


def check_json_content_type(request: Request) -> None:
    """Requires ``Content-Type: application/json`` (parameters such as charset allowed).

    Raises:
        StarletteHTTPException: 415 otherwise.
    """
    content_type = request.headers.get("content-type", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type != JSON_MEDIA_TYPE:
        shown = content_type[:100] or "none"
        raise StarletteHTTPException(415, f"Content-Type must be {JSON_MEDIA_TYPE}, got {shown}")


def _too_large(max_bytes: int) -> PdserveError:
    return PdserveError(
        ErrorReason.REQUEST_TOO_LARGE,
        f"the request body is larger than {max_bytes} bytes",
        {"param": "body", "maxBytes": str(max_bytes)},
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused early if it is larger than `max_bytes`.

    A ``Content-Length`` over the limit is refused before anything is read; a body without one
    (chunked) is refused as soon as it grows past the limit.

    Raises:
        PdserveError: REQUEST_TOO_LARGE (413); CANCELLED when the client goes away meanwhile.
    """
    length = request.headers.get("content-length")
    if length is not None and (
        len(length) > MAX_CONTENT_LENGTH_DIGITS or (length.isdigit() and int(length) > max_bytes)
    ):
        raise _too_large(max_bytes)
    chunks = []
    num_bytes = 0
    try:
        async for chunk in request.stream():
            num_bytes += len(chunk)
            if num_bytes > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise PdserveError(ErrorReason.CANCELLED, "the client went away") from None
    return b"".join(chunks)


class RequestIdMiddleware:
    """Gives each HTTP request an id (``X-Request-Id``) and answers what no handler took.

    An exception that escapes the application becomes a 500 OpenAI error body naming the
    request id, with ``Connection: close``, instead of a plain-text "Internal Server Error" on a
    connection the server then resets. If the response had started already, it is cut short.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        is_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
                headers = MutableHeaders(scope=message)
                if REQUEST_ID_HEADER not in headers:
                    headers[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception(
                "internal_error",
                request_id=request_id,
                method=scope.get("method"),
                path=scope.get("path"),
                is_response_started=is_started,
            )
            if is_started:
                return  # the server closes a response the application left unfinished
            body = error_body(
                f"internal server error (request id {request_id})",
                500,
                ErrorReason.INTERNAL.name.lower(),
            )
            response = JSONResponse(
                body, status_code=500, headers={REQUEST_ID_HEADER: request_id, **CLOSE}
            )
            await response(scope, receive, send)
