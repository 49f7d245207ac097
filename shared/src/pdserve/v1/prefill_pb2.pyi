from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeTarget(_message.Message):
    __slots__ = ("address", "instance_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    instance_id: str
    def __init__(self, address: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "num_prompt_tokens", "sampling", "decode", "protocol", "share_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SHARE_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    decode: DecodeTarget
    protocol: _common_pb2.Protocol
    share_key: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode: _Optional[_Union[DecodeTarget, _Mapping]] = ..., protocol: _Optional[_Union[_common_pb2.Protocol, _Mapping]] = ..., share_key: _Optional[str] = ...) -> None: ...

class PrefillPhases(_message.Message):
    __slots__ = ("lease_us", "queue_us", "compute_us", "transfer_tail_us", "transport")
    LEASE_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TAIL_US_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    lease_us: int
    queue_us: int
    compute_us: int
    transfer_tail_us: int
    transport: str
    def __init__(self, lease_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., compute_us: _Optional[int] = ..., transfer_tail_us: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "index", "phases", "logprobs", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    index: int
    phases: PrefillPhases
    logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_id: _Optional[int] = ..., index: _Optional[int] = ..., phases: _Optional[_Union[PrefillPhases, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class HandedOff(_message.Message):
    __slots__ = ("lease_id", "decode_instance_id", "num_bytes", "num_chunks", "transport", "phases")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    decode_instance_id: str
    num_bytes: int
    num_chunks: int
    transport: str
    phases: PrefillPhases
    def __init__(self, lease_id: _Optional[str] = ..., decode_instance_id: _Optional[str] = ..., num_bytes: _Optional[int] = ..., num_chunks: _Optional[int] = ..., transport: _Optional[str] = ..., phases: _Optional[_Union[PrefillPhases, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "handed_off", "finished")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    handed_off: HandedOff
    finished: _common_pb2.Finished
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., handed_off: _Optional[_Union[HandedOff, _Mapping]] = ..., finished: _Optional[_Union[_common_pb2.Finished, _Mapping]] = ...) -> None: ...

class AbortRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortRequestResponse(_message.Message):
    __slots__ = ("was_known",)
    WAS_KNOWN_FIELD_NUMBER: _ClassVar[int]
    was_known: bool
    def __init__(self, was_known: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "tokenizer_json", "tokenizer_config_json", "chat_template", "eos_token_ids", "max_model_len", "kv_layout", "instance")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    tokenizer_json: str
    tokenizer_config_json: str
    chat_template: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    kv_layout: _common_pb2.KvLayout
    instance: _common_pb2.InstanceInfo
    def __init__(self, model_name: _Optional[str] = ..., tokenizer_json: _Optional[str] = ..., tokenizer_config_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ..., kv_layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., instance: _Optional[_Union[_common_pb2.InstanceInfo, _Mapping]] = ...) -> None: ...
