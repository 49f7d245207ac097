"""API-key checks shared by the REST and gRPC front ends."""

from __future__ import annotations

import hmac

from pdserve.common.errors import ErrorReason, PdserveError

BEARER_PREFIX = "bearer "


def check_bearer(authorization: str | None, api_key: str | None) -> None:
    """Accepts ``Bearer <api_key>`` (any case of "Bearer"); no key configured accepts all.

    Args:
        authorization: The ``Authorization`` header or ``authorization`` metadata value.
        api_key: The configured key, or None when the gateway is open.

    Raises:
        PdserveError: UNAUTHENTICATED when the key is missing or wrong.
    """
    if api_key is None:
        return
    presented = bearer_token(authorization)
    if presented is None:
        raise PdserveError(
            ErrorReason.UNAUTHENTICATED,
            "missing API key: send 'Authorization: Bearer <key>'",
        )
    if not hmac.compare_digest(presented.encode(), api_key.encode()):
        raise PdserveError(ErrorReason.UNAUTHENTICATED, "invalid API key")


def bearer_token(authorization: str | None) -> str | None:
    """The token of a ``Bearer <token>`` header or metadata value, or None without one."""
    if authorization is None or not authorization.lower().startswith(BEARER_PREFIX):
        return None
    return authorization[len(BEARER_PREFIX) :].strip()
