from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("instance", "load")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    instance: _common_pb2.InstanceInfo
    load: _common_pb2.LoadReport
    def __init__(self, instance: _Optional[_Union[_common_pb2.InstanceInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "instance_ttl_ms", "protocol")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    instance_ttl_ms: int
    protocol: _common_pb2.Protocol
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., instance_ttl_ms: _Optional[int] = ..., protocol: _Optional[_Union[_common_pb2.Protocol, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("instance_id", "load")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    load: _common_pb2.LoadReport
    def __init__(self, instance_id: _Optional[str] = ..., load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms",)
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
