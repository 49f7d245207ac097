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
    if authorization is None or not authorization.lower().startswith(BEARER_PREFIX):
        raise PdserveError(
            ErrorReason.UNAUTHENTICATED,
            "missing API key: send 'Authorization: Bearer <key>'",
        )
    presented = authorization[len(BEARER_PREFIX) :].strip()
    if not hmac.compare_digest(presented.encode(), api_key.encode()):
        raise PdserveError(ErrorReason.UNAUTHENTICATED, "invalid API key")
