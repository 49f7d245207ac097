"""Who may write KV into a lease or release it: the rules as pure functions of the lease and
the caller.

Every lease carries an unguessable token (`new_lease_token`), sent to the prefill that allocated
it in the Lease message and never logged. The rules:

* **SyncCache** (any transport) needs the token, and only while the lease is ALLOCATED (after
  commit, release, expiry or failure the token is void); with mTLS the caller must also be the
  prefill that allocated the lease. The TCP data port has no caller identities: there the token
  is the whole credential (it reached the allocating prefill over the authenticated plane).
* **ReleaseLease** needs the lease's request id. With mTLS it is then allowed with the token, to
  the prefill that allocated the lease, or to any gateway. On a plaintext plane (no caller
  identity) the request id alone suffices: that plane trusts every caller that reaches it (the
  weaker rule `--insecure` warns about); the token is accepted there too.

Each check returns None when allowed, else why not (the PERMISSION_DENIED message, built and
logged by `denied`); a refusal never changes the lease, so a stranger cannot end someone else's
lease by sending garbage. `LeaseManager` applies the checks under its lock.
"""

from __future__ import annotations

import hmac
import secrets

import structlog

from pdserve.common.authz import GATEWAY
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.pki import Identity
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.request import DecodeRequest

log = structlog.get_logger(__name__)

NUM_TOKEN_BYTES = 32


def new_lease_token() -> bytes:
    """A fresh lease token (256 random bits)."""
    return secrets.token_bytes(NUM_TOKEN_BYTES)


def peer_key(caller: Identity | None, prefill_instance_id: str) -> str:
    """Whose share of the pool a new lease counts against: the caller's certified identity,
    else (plaintext plane) the prefill instance id it states."""
    return str(caller) if caller is not None else prefill_instance_id


def has_token(lease: DecodeRequest, token: bytes) -> bool:
    """Whether `token` is the lease's (constant time; an empty token never matches)."""
    return bool(lease.lease_token) and hmac.compare_digest(lease.lease_token, token)


def sync_refusal(
    lease: DecodeRequest, token: bytes, caller: Identity | None, *, is_insecure: bool
) -> str | None:
    """Why `caller` may not start a SyncCache transfer into `lease` with `token`, or None."""
    if not has_token(lease, token):
        return "the transport token does not match the lease"
    if lease.status is not RequestStatus.ALLOCATED:
        return f"the lease is {lease.status.name}: its transport token is void"
    if caller is None:
        return None if is_insecure else "the caller has no verified identity"
    if lease.allocated_by is not None and caller != lease.allocated_by:
        return f"{caller} did not allocate this lease"
    return None


def release_refusal(
    lease: DecodeRequest,
    request_id: str,
    token: bytes,
    caller: Identity | None,
    *,
    is_insecure: bool,
) -> str | None:
    """Why `caller` may not release `lease` (of `request_id`, with `token`), or None."""
    if request_id != lease.request_id:
        return "the request id is not the lease's"
    if has_token(lease, token):
        return None
    if caller is None:
        # NOTE: the documented weaker rule of a plaintext plane: the request id suffices.
        return None if is_insecure else "the caller has no verified identity"
    if caller.role == GATEWAY:
        return None
    if lease.allocated_by is not None and caller == lease.allocated_by:
        return None
    return f"{caller} neither allocated this lease nor holds its token"


def denied(
    rpc: str, lease: DecodeRequest, caller: Identity | None, refusal: str, num_refused: int
) -> PdserveError:
    """Logs a refused `rpc` (the `num_refused`-th) and returns its PERMISSION_DENIED error."""
    # NOTE: never the token, nor a message or repr that carries it.
    log.warning(
        "lease_access_refused",
        rpc=rpc,
        lease_id=lease.lease_id,
        caller=None if caller is None else str(caller),
        detail=refusal,
        num_refused=num_refused,
    )
    # NOTE: not the request id in the error: on a plaintext plane it is a credential too.
    return PdserveError(ErrorReason.PERMISSION_DENIED, refusal, {"leaseId": lease.lease_id})
