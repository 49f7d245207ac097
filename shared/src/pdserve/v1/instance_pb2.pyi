from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInstanceStatusRequest(_message.Message):
    __slots__ = ("check_integrity",)
    CHECK_INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    check_integrity: bool
    def __init__(self, check_integrity: _Optional[bool] = ...) -> None: ...

class GetInstanceStatusResponse(_message.Message):
    __slots__ = ("instance", "load", "pool", "insecure", "attention_backend")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    INSECURE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    instance: _common_pb2.InstanceInfo
    load: _common_pb2.LoadReport
    pool: _common_pb2.PoolIntegrity
    insecure: bool
    attention_backend: str
    def __init__(self, instance: _Optional[_Union[_common_pb2.InstanceInfo, _Mapping]] = ..., load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ..., pool: _Optional[_Union[_common_pb2.PoolIntegrity, _Mapping]] = ..., insecure: _Optional[bool] = ..., attention_backend: _Optional[str] = ...) -> None: ...
