"""The pdserve.v1 error model: typed errors, their gRPC status, and parsing them back.

A failed RPC carries a gRPC status whose details hold exactly one `google.rpc.ErrorInfo`
(domain ``pdserve.v1``, ``reason`` an `ErrorReason` name, lowerCamelCase metadata including
``retryScope``) and, where waiting helps, one `google.rpc.RetryInfo`. Servers raise
`PdserveError`; `abort_with_error` turns it into that status; clients call `from_rpc_error` to
get the typed error back. Nothing here matches on message text.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

ERROR_DOMAIN = "pdserve.v1"
RETRY_SCOPE_KEY = "retryScope"
TAKEN_OVER_KEY = "takenOver"
"""Metadata a decode sets ("true") on the CANCELLED that ends a Generate stream another
(``resume``) stream took over (contract 1.9)."""


class RetryScope(enum.Enum):
    """What a client may do after an error (mirrors pdserve.v1.RetryScope)."""

    NEVER = "NEVER"
    ONCE = "ONCE"
    ANOTHER_PAIR = "ANOTHER_PAIR"
    ANOTHER_DECODE = "ANOTHER_DECODE"
    ANOTHER_PREFILL = "ANOTHER_PREFILL"
    ANOTHER_INSTANCE = "ANOTHER_INSTANCE"
    WHOLE_REQUEST = "WHOLE_REQUEST"
    RESCHEDULE = "RESCHEDULE"
    REGISTER_AGAIN = "REGISTER_AGAIN"


class ErrorReason(enum.Enum):
    """Machine-readable cause of a failure (mirrors pdserve.v1.ErrorReason without prefix)."""

    INVALID_REQUEST = "INVALID_REQUEST"
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
    INCOMPATIBLE_PEER = "INCOMPATIBLE_PEER"
    DECODE_CAPACITY_EXHAUSTED = "DECODE_CAPACITY_EXHAUSTED"
    PREFILL_OVERLOADED = "PREFILL_OVERLOADED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    LEASE_NOT_FOUND = "LEASE_NOT_FOUND"
    CACHE_SYNC_FAILED = "CACHE_SYNC_FAILED"
    PREEMPTED = "PREEMPTED"
    INSTANCE_DRAINING = "INSTANCE_DRAINING"
    PEER_UNAVAILABLE = "PEER_UNAVAILABLE"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    INSTANCE_NOT_REGISTERED = "INSTANCE_NOT_REGISTERED"
    NO_HEALTHY_INSTANCES = "NO_HEALTHY_INSTANCES"
    REQUEST_TOO_LARGE = "REQUEST_TOO_LARGE"
    RATE_LIMITED = "RATE_LIMITED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    REQUEST_NOT_FOUND = "REQUEST_NOT_FOUND"


@dataclass(frozen=True)
class ReasonSpec:
    """The contract row of one reason: its gRPC code(s), retry scope and HTTP status."""

    codes: tuple[grpc.StatusCode, ...]  # first is the default
    retry_scope: RetryScope
    http_status: int

    @property
    def code(self) -> grpc.StatusCode:
        return self.codes[0]


_S = grpc.StatusCode
# NOTE: this table is the contract (DESIGN section 3, errors.proto comments); tests hold the
# proto, this table and the wire behaviour to each other.
REASON_SPECS: Mapping[ErrorReason, ReasonSpec] = {
    ErrorReason.INVALID_REQUEST: ReasonSpec((_S.INVALID_ARGUMENT,), RetryScope.NEVER, 400),
    ErrorReason.PROMPT_TOO_LONG: ReasonSpec((_S.INVALID_ARGUMENT,), RetryScope.NEVER, 400),
    ErrorReason.INCOMPATIBLE_PEER: ReasonSpec(
        (_S.FAILED_PRECONDITION,), RetryScope.ANOTHER_PAIR, 503
    ),
    ErrorReason.DECODE_CAPACITY_EXHAUSTED: ReasonSpec(
        (_S.RESOURCE_EXHAUSTED,), RetryScope.ANOTHER_DECODE, 429
    ),
    ErrorReason.PREFILL_OVERLOADED: ReasonSpec(
        (_S.RESOURCE_EXHAUSTED,), RetryScope.ANOTHER_PREFILL, 429
    ),
    ErrorReason.LEASE_EXPIRED: ReasonSpec((_S.NOT_FOUND,), RetryScope.WHOLE_REQUEST, 503),
    ErrorReason.LEASE_NOT_FOUND: ReasonSpec((_S.NOT_FOUND,), RetryScope.WHOLE_REQUEST, 503),
    ErrorReason.CACHE_SYNC_FAILED: ReasonSpec(
        (_S.DATA_LOSS, _S.ABORTED), RetryScope.WHOLE_REQUEST, 503
    ),
    ErrorReason.PREEMPTED: ReasonSpec((_S.ABORTED,), RetryScope.RESCHEDULE, 503),
    ErrorReason.INSTANCE_DRAINING: ReasonSpec((_S.UNAVAILABLE,), RetryScope.ANOTHER_INSTANCE, 503),
    ErrorReason.PEER_UNAVAILABLE: ReasonSpec((_S.UNAVAILABLE,), RetryScope.ANOTHER_INSTANCE, 503),
    ErrorReason.CANCELLED: ReasonSpec((_S.CANCELLED, _S.ABORTED), RetryScope.NEVER, 499),
    ErrorReason.DEADLINE_EXCEEDED: ReasonSpec((_S.DEADLINE_EXCEEDED,), RetryScope.NEVER, 504),
    ErrorReason.INTERNAL: ReasonSpec((_S.INTERNAL,), RetryScope.ONCE, 500),
    ErrorReason.UNAUTHENTICATED: ReasonSpec((_S.UNAUTHENTICATED,), RetryScope.NEVER, 401),
    ErrorReason.MODEL_NOT_FOUND: ReasonSpec((_S.NOT_FOUND,), RetryScope.NEVER, 404),
    ErrorReason.INSTANCE_NOT_REGISTERED: ReasonSpec(
        (_S.NOT_FOUND,), RetryScope.REGISTER_AGAIN, 503
    ),
    ErrorReason.NO_HEALTHY_INSTANCES: ReasonSpec(
        (_S.UNAVAILABLE,), RetryScope.ANOTHER_INSTANCE, 503
    ),
    ErrorReason.REQUEST_TOO_LARGE: ReasonSpec((_S.RESOURCE_EXHAUSTED,), RetryScope.NEVER, 413),
    ErrorReason.RATE_LIMITED: ReasonSpec((_S.RESOURCE_EXHAUSTED,), RetryScope.WHOLE_REQUEST, 429),
    ErrorReason.PERMISSION_DENIED: ReasonSpec((_S.PERMISSION_DENIED,), RetryScope.NEVER, 403),
    ErrorReason.REQUEST_NOT_FOUND: ReasonSpec((_S.NOT_FOUND,), RetryScope.NEVER, 404),
}


@dataclass
class PdserveError(Exception):
    """A failure with a pdserve.v1 reason, raised by servers and re-created on clients.

    Attributes:
        reason: The machine-readable cause.
        message: Human-readable description (for people and logs only).
        metadata: lowerCamelCase details, e.g. ``{"leaseId": "..."}``.
        retry_delay_s: Suggested wait before retrying, or None.
        code: gRPC status code; defaults to the reason's contract code.
    """

    reason: ErrorReason
    message: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    retry_delay_s: float | None = None
    code: grpc.StatusCode | None = None

    def __post_init__(self) -> None:
        spec = REASON_SPECS[self.reason]
        if self.code is None:
            self.code = spec.code
        elif self.code not in spec.codes:
            raise ValueError(f"{self.reason.name} cannot use gRPC code {self.code.name}")
        super().__init__(self.message or self.reason.name)

    def __str__(self) -> str:
        return f"{self.reason.name}: {self.message}" if self.message else self.reason.name

    def __reduce__(self) -> tuple[type[PdserveError], tuple[object, ...]]:
        # NOTE: an exception pickles as cls(*args), and args holds only the message; rebuild it
        # from its fields instead, so it can cross a process boundary.
        return type(self), (self.reason, self.message, self.metadata, self.retry_delay_s, self.code)

    @property
    def retry_scope(self) -> RetryScope:
        return REASON_SPECS[self.reason].retry_scope

    @property
    def http_status(self) -> int:
        return REASON_SPECS[self.reason].http_status

    @property
    def is_retryable(self) -> bool:
        return self.retry_scope is not RetryScope.NEVER

    def to_status(self) -> grpc.Status:
        """Builds the gRPC status with one ErrorInfo (and RetryInfo when a delay is set)."""
        assert self.code is not None
        info = error_details_pb2.ErrorInfo(
            reason=self.reason.name,
            domain=ERROR_DOMAIN,
            metadata={**self.metadata, RETRY_SCOPE_KEY: self.retry_scope.name},
        )
        details = [_pack(info)]
        if self.retry_delay_s is not None:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(round(self.retry_delay_s * 1e9))
            details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
        status = status_pb2.Status(
            code=getattr(code_pb2, self.code.name), message=str(self), details=details
        )
        return rpc_status.to_status(status)


def _pack(message: error_details_pb2.ErrorInfo | error_details_pb2.RetryInfo) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


async def abort_with_error(context: grpc.aio.ServicerContext, error: PdserveError) -> NoReturn:
    """Ends an aio RPC with `error`'s status. Never returns."""
    await context.abort_with_status(error.to_status())
    raise AssertionError("abort_with_status returned")  # pragma: no cover


def from_rpc_error(error: grpc.RpcError) -> PdserveError:
    """Re-creates the typed error a pdserve server sent.

    A status without a pdserve.v1 ErrorInfo (a transport failure, a foreign server) is mapped
    by its gRPC code: UNAVAILABLE to PEER_UNAVAILABLE, DEADLINE_EXCEEDED and CANCELLED to
    themselves, anything else to INTERNAL.
    """
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else ""
    status = _status_from_error(error)
    if status is not None:
        parsed = _parse_status(status)
        if parsed is not None:
            return parsed
    reason = {
        grpc.StatusCode.UNAVAILABLE: ErrorReason.PEER_UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED: ErrorReason.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED: ErrorReason.CANCELLED,
        grpc.StatusCode.UNAUTHENTICATED: ErrorReason.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED: ErrorReason.PERMISSION_DENIED,
    }.get(code, ErrorReason.INTERNAL)
    return PdserveError(reason, details or code.name)


def has_error_info(error: grpc.RpcError) -> bool:
    """Whether a failed call's status carries a pdserve.v1 ErrorInfo.

    A status without one was not sent by a pdserve server's error helper: a transport failure,
    a foreign server, or a status the client library made up locally.
    """
    status = _status_from_error(error)
    return status is not None and _parse_status(status) is not None


def _status_from_error(error: grpc.RpcError) -> status_pb2.Status | None:
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == rpc_status.GRPC_DETAILS_METADATA_KEY:
            return status_pb2.Status.FromString(value)
    return None


def _parse_status(status: status_pb2.Status) -> PdserveError | None:
    info: error_details_pb2.ErrorInfo | None = None
    retry_delay_s: float | None = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            candidate = error_details_pb2.ErrorInfo()
            detail.Unpack(candidate)
            if candidate.domain == ERROR_DOMAIN and info is None:
                info = candidate
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_delay_s = retry.retry_delay.ToNanoseconds() / 1e9
    if info is None or info.reason not in ErrorReason.__members__:
        return None
    reason = ErrorReason[info.reason]
    metadata = {k: v for k, v in info.metadata.items() if k != RETRY_SCOPE_KEY}
    code = grpc.StatusCode[code_pb2.Code.Name(status.code)]
    if code not in REASON_SPECS[reason].codes:
        code = None  # a peer used a non-contract code: keep the reason, use its default code
    message = status.message.removeprefix(f"{reason.name}: ")
    return PdserveError(reason, message, metadata, retry_delay_s, code)


def is_taken_over(error: PdserveError) -> bool:
    """Whether `error` ended a decode Generate stream because another stream took its request
    over (`TAKEN_OVER_KEY`)."""
    return error.reason is ErrorReason.CANCELLED and error.metadata.get(TAKEN_OVER_KEY) == "true"
