from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_REQUEST: _ClassVar[ErrorReason]
    ERROR_REASON_PROMPT_TOO_LONG: _ClassVar[ErrorReason]
    ERROR_REASON_INCOMPATIBLE_PEER: _ClassVar[ErrorReason]
    ERROR_REASON_DECODE_CAPACITY_EXHAUSTED: _ClassVar[ErrorReason]
    ERROR_REASON_PREFILL_OVERLOADED: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_EXPIRED: _ClassVar[ErrorReason]
    ERROR_REASON_LEASE_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_CACHE_SYNC_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_PREEMPTED: _ClassVar[ErrorReason]
    ERROR_REASON_INSTANCE_DRAINING: _ClassVar[ErrorReason]
    ERROR_REASON_PEER_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_CANCELLED: _ClassVar[ErrorReason]
    ERROR_REASON_DEADLINE_EXCEEDED: _ClassVar[ErrorReason]
    ERROR_REASON_INTERNAL: _ClassVar[ErrorReason]
    ERROR_REASON_UNAUTHENTICATED: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_INSTANCE_NOT_REGISTERED: _ClassVar[ErrorReason]
    ERROR_REASON_NO_HEALTHY_INSTANCES: _ClassVar[ErrorReason]

class RetryScope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETRY_SCOPE_UNSPECIFIED: _ClassVar[RetryScope]
    RETRY_SCOPE_NEVER: _ClassVar[RetryScope]
    RETRY_SCOPE_ONCE: _ClassVar[RetryScope]
    RETRY_SCOPE_ANOTHER_PAIR: _ClassVar[RetryScope]
    RETRY_SCOPE_ANOTHER_DECODE: _ClassVar[RetryScope]
    RETRY_SCOPE_ANOTHER_PREFILL: _ClassVar[RetryScope]
    RETRY_SCOPE_ANOTHER_INSTANCE: _ClassVar[RetryScope]
    RETRY_SCOPE_WHOLE_REQUEST: _ClassVar[RetryScope]
    RETRY_SCOPE_RESCHEDULE: _ClassVar[RetryScope]
    RETRY_SCOPE_REGISTER_AGAIN: _ClassVar[RetryScope]
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_INVALID_REQUEST: ErrorReason
ERROR_REASON_PROMPT_TOO_LONG: ErrorReason
ERROR_REASON_INCOMPATIBLE_PEER: ErrorReason
ERROR_REASON_DECODE_CAPACITY_EXHAUSTED: ErrorReason
ERROR_REASON_PREFILL_OVERLOADED: ErrorReason
ERROR_REASON_LEASE_EXPIRED: ErrorReason
ERROR_REASON_LEASE_NOT_FOUND: ErrorReason
ERROR_REASON_CACHE_SYNC_FAILED: ErrorReason
ERROR_REASON_PREEMPTED: ErrorReason
ERROR_REASON_INSTANCE_DRAINING: ErrorReason
ERROR_REASON_PEER_UNAVAILABLE: ErrorReason
ERROR_REASON_CANCELLED: ErrorReason
ERROR_REASON_DEADLINE_EXCEEDED: ErrorReason
ERROR_REASON_INTERNAL: ErrorReason
ERROR_REASON_UNAUTHENTICATED: ErrorReason
ERROR_REASON_MODEL_NOT_FOUND: ErrorReason
ERROR_REASON_INSTANCE_NOT_REGISTERED: ErrorReason
ERROR_REASON_NO_HEALTHY_INSTANCES: ErrorReason
RETRY_SCOPE_UNSPECIFIED: RetryScope
RETRY_SCOPE_NEVER: RetryScope
RETRY_SCOPE_ONCE: RetryScope
RETRY_SCOPE_ANOTHER_PAIR: RetryScope
RETRY_SCOPE_ANOTHER_DECODE: RetryScope
RETRY_SCOPE_ANOTHER_PREFILL: RetryScope
RETRY_SCOPE_ANOTHER_INSTANCE: RetryScope
RETRY_SCOPE_WHOLE_REQUEST: RetryScope
RETRY_SCOPE_RESCHEDULE: RetryScope
RETRY_SCOPE_REGISTER_AGAIN: RetryScope
