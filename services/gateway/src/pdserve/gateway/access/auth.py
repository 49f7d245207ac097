"""API-key checks shared by the REST and gRPC front ends: who a request comes from."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.access.api_keys import ApiKey, ApiKeyStore

BEARER_PREFIX = "bearer "
ANONYMOUS = ""


class Caller(NamedTuple):
    """Who a request comes from, as the limits and the logs see it.

    Attributes:
        api_key: The key it authenticated with; None on an open gateway.
        limit_key: What the per-key limits count by: ``key:<name>``; on an open gateway a digest
            of the token presented, and `ANONYMOUS` (shared) for requests without one.
    """

    api_key: ApiKey | None
    limit_key: str

    @property
    def api_key_name(self) -> str | None:
        """The key's name (for logs and spans), or None on an open gateway."""
        return None if self.api_key is None else self.api_key.name


def authenticate(authorization: str | None, keys: ApiKeyStore) -> Caller:
    """Accepts ``Bearer <key>`` (any case of "Bearer") for a key in `keys`; an open store
    accepts everything.

    Args:
        authorization: The ``Authorization`` header or ``authorization`` metadata value.
        keys: The keys accepted now.

    Raises:
        PdserveError: UNAUTHENTICATED when the key is missing or unknown.
    """
    presented = bearer_token(authorization)
    if keys.is_open:
        if not presented:
            return Caller(None, ANONYMOUS)
        # NOTE: a digest, so the limiters never hold the tokens themselves.
        digest = hashlib.blake2b(presented.encode(), digest_size=16).hexdigest()
        return Caller(None, f"token:{digest}")
    if presented is None:
        raise PdserveError(
            ErrorReason.UNAUTHENTICATED,
            "missing API key: send 'Authorization: Bearer <key>'",
        )
    api_key = keys.match(presented)
    if api_key is None:
        raise PdserveError(ErrorReason.UNAUTHENTICATED, "invalid API key")
    return Caller(api_key, f"key:{api_key.name}")


def bearer_token(authorization: str | None) -> str | None:
    """The token of a ``Bearer <token>`` header or metadata value, or None without one."""
    if authorization is None or not authorization.lower().startswith(BEARER_PREFIX):
        return None
    return authorization[len(BEARER_PREFIX) :].strip()
