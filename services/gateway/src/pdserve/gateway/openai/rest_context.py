"""What every REST route of the gateway holds: the parts it calls and the request limits."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import Request

from pdserve.gateway.access.admission import ConcurrencyLimiter
from pdserve.gateway.access.api_keys import ApiKeyStore
from pdserve.gateway.access.auth import Caller, authenticate
from pdserve.gateway.frontend import Frontend
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai.http import check_json_content_type, read_body
from pdserve.gateway.openai.responses_api.stored import StoredResponses
from pdserve.gateway.prepare.workers import ParserPool
from pdserve.gateway.session.sessions import Sessions
from pdserve.gateway.streaming import Streamer


@dataclass(frozen=True)
class RestContext:
    """The parts the REST routes share: `pdserve.gateway.openai.api.create_app`'s arguments
    (``api_keys`` always set: an open store accepts any key; ``stored`` set where
    ``sessions`` can keep requests)."""

    frontend: Frontend
    streamer: Streamer
    sessions: Sessions
    metrics: GatewayMetrics
    limiter: ConcurrencyLimiter
    parser: ParserPool
    max_body_bytes: int
    api_keys: ApiKeyStore = field(default_factory=ApiKeyStore)
    now: Callable[[], float] = time.time
    internal_plane: str = "mtls"
    stored: StoredResponses | None = None

    def authorize(self, request: Request) -> Caller:
        """The caller of `request` by its Bearer key (401 without a valid one)."""
        return authenticate(request.headers.get("authorization"), self.api_keys)

    async def json_body(self, request: Request) -> bytes:
        """The request's JSON body, within the size limit (415, 413)."""
        check_json_content_type(request)
        return await read_body(request, self.max_body_bytes)
