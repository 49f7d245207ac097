from pdserve.v1 import common_pb2 as _common_pb2
from pdserve.v1 import errors_pb2 as _errors_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_KIND_UNSPECIFIED: _ClassVar[TransportKind]
    TRANSPORT_KIND_GRPC_SYNC_CACHE: _ClassVar[TransportKind]
    TRANSPORT_KIND_TCP: _ClassVar[TransportKind]
    TRANSPORT_KIND_SHARED_MEMORY: _ClassVar[TransportKind]
    TRANSPORT_KIND_CUDA_IPC: _ClassVar[TransportKind]
    TRANSPORT_KIND_NIXL: _ClassVar[TransportKind]

class LeaseState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_STATE_UNSPECIFIED: _ClassVar[LeaseState]
    LEASE_STATE_ALLOCATED: _ClassVar[LeaseState]
    LEASE_STATE_SYNCING: _ClassVar[LeaseState]
    LEASE_STATE_COMMITTED: _ClassVar[LeaseState]
    LEASE_STATE_RUNNING: _ClassVar[LeaseState]
    LEASE_STATE_FINISHED: _ClassVar[LeaseState]
    LEASE_STATE_PREEMPTED: _ClassVar[LeaseState]
    LEASE_STATE_ABORTED: _ClassVar[LeaseState]
    LEASE_STATE_EXPIRED: _ClassVar[LeaseState]
    LEASE_STATE_FAILED: _ClassVar[LeaseState]

class PreemptionReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREEMPTION_REASON_UNSPECIFIED: _ClassVar[PreemptionReason]
    PREEMPTION_REASON_OUT_OF_BLOCKS: _ClassVar[PreemptionReason]
    PREEMPTION_REASON_DRAINING: _ClassVar[PreemptionReason]
TRANSPORT_KIND_UNSPECIFIED: TransportKind
TRANSPORT_KIND_GRPC_SYNC_CACHE: TransportKind
TRANSPORT_KIND_TCP: TransportKind
TRANSPORT_KIND_SHARED_MEMORY: TransportKind
TRANSPORT_KIND_CUDA_IPC: TransportKind
TRANSPORT_KIND_NIXL: TransportKind
LEASE_STATE_UNSPECIFIED: LeaseState
LEASE_STATE_ALLOCATED: LeaseState
LEASE_STATE_SYNCING: LeaseState
LEASE_STATE_COMMITTED: LeaseState
LEASE_STATE_RUNNING: LeaseState
LEASE_STATE_FINISHED: LeaseState
LEASE_STATE_PREEMPTED: LeaseState
LEASE_STATE_ABORTED: LeaseState
LEASE_STATE_EXPIRED: LeaseState
LEASE_STATE_FAILED: LeaseState
PREEMPTION_REASON_UNSPECIFIED: PreemptionReason
PREEMPTION_REASON_OUT_OF_BLOCKS: PreemptionReason
PREEMPTION_REASON_DRAINING: PreemptionReason

class NixlTarget(_message.Message):
    __slots__ = ("agent_metadata", "agent_name", "memory_kind", "device_id", "block_addresses", "layer_stride_bytes", "kv_stride_bytes", "block_nbytes", "window_layers", "window_block_addresses", "window_layer_stride_bytes", "window_kv_stride_bytes")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BLOCK_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_LAYER_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_KV_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    agent_name: str
    memory_kind: str
    device_id: int
    block_addresses: _containers.RepeatedScalarFieldContainer[int]
    layer_stride_bytes: int
    kv_stride_bytes: int
    block_nbytes: int
    window_layers: _containers.RepeatedScalarFieldContainer[int]
    window_block_addresses: _containers.RepeatedScalarFieldContainer[int]
    window_layer_stride_bytes: int
    window_kv_stride_bytes: int
    def __init__(self, agent_metadata: _Optional[bytes] = ..., agent_name: _Optional[str] = ..., memory_kind: _Optional[str] = ..., device_id: _Optional[int] = ..., block_addresses: _Optional[_Iterable[int]] = ..., layer_stride_bytes: _Optional[int] = ..., kv_stride_bytes: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., window_layers: _Optional[_Iterable[int]] = ..., window_block_addresses: _Optional[_Iterable[int]] = ..., window_layer_stride_bytes: _Optional[int] = ..., window_kv_stride_bytes: _Optional[int] = ...) -> None: ...

class KvCacheHandle(_message.Message):
    __slots__ = ("host_id", "process_id", "device_kind", "memory_handle", "device_index", "offset_bytes", "num_bytes", "ref_counter_handle", "ref_counter_offset")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    process_id: int
    device_kind: str
    memory_handle: bytes
    device_index: int
    offset_bytes: int
    num_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    def __init__(self, host_id: _Optional[str] = ..., process_id: _Optional[int] = ..., device_kind: _Optional[str] = ..., memory_handle: _Optional[bytes] = ..., device_index: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., num_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ...) -> None: ...

class Transport(_message.Message):
    __slots__ = ("kind", "address", "token", "cache_handle", "nixl")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    kind: TransportKind
    address: str
    token: bytes
    cache_handle: KvCacheHandle
    nixl: NixlTarget
    def __init__(self, kind: _Optional[_Union[TransportKind, str]] = ..., address: _Optional[str] = ..., token: _Optional[bytes] = ..., cache_handle: _Optional[_Union[KvCacheHandle, _Mapping]] = ..., nixl: _Optional[_Union[NixlTarget, _Mapping]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "block_ids", "block_size", "expires_at_unix_ms", "ttl_ms", "transports", "decode_instance_id", "num_shared_blocks", "num_window_skipped_blocks", "num_window_slots", "window_slot_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WINDOW_SLOTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    expires_at_unix_ms: int
    ttl_ms: int
    transports: _containers.RepeatedCompositeFieldContainer[Transport]
    decode_instance_id: str
    num_shared_blocks: int
    num_window_skipped_blocks: int
    num_window_slots: int
    window_slot_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., transports: _Optional[_Iterable[_Union[Transport, _Mapping]]] = ..., decode_instance_id: _Optional[str] = ..., num_shared_blocks: _Optional[int] = ..., num_window_skipped_blocks: _Optional[int] = ..., num_window_slots: _Optional[int] = ..., window_slot_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocateBlocksRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "max_new_tokens", "kv_layout", "protocol", "prefill_instance_id", "share_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARE_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    max_new_tokens: int
    kv_layout: _common_pb2.KvLayout
    protocol: _common_pb2.Protocol
    prefill_instance_id: str
    share_key: str
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., kv_layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., protocol: _Optional[_Union[_common_pb2.Protocol, _Mapping]] = ..., prefill_instance_id: _Optional[str] = ..., share_key: _Optional[str] = ...) -> None: ...

class AllocateBlocksResponse(_message.Message):
    __slots__ = ("lease", "protocol")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    protocol: _common_pb2.Protocol
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ..., protocol: _Optional[_Union[_common_pb2.Protocol, _Mapping]] = ...) -> None: ...

class SyncCacheHeader(_message.Message):
    __slots__ = ("lease_id", "request_id", "token_ids", "num_prompt_tokens", "sampling", "transport_token", "transport")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    transport_token: bytes
    transport: TransportKind
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., transport_token: _Optional[bytes] = ..., transport: _Optional[_Union[TransportKind, str]] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("layer_index", "first_block", "num_blocks", "key", "value", "crc32c")
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    layer_index: int
    first_block: int
    num_blocks: int
    key: bytes
    value: bytes
    crc32c: int
    def __init__(self, layer_index: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., crc32c: _Optional[int] = ...) -> None: ...

class SyncCacheCommit(_message.Message):
    __slots__ = ("num_chunks", "num_bytes", "first_token_id", "first_token_index")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_INDEX_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    num_bytes: int
    first_token_id: int
    first_token_index: int
    def __init__(self, num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., first_token_id: _Optional[int] = ..., first_token_index: _Optional[int] = ...) -> None: ...

class SyncCacheRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: SyncCacheHeader
    chunk: KvChunk
    commit: SyncCacheCommit
    def __init__(self, header: _Optional[_Union[SyncCacheHeader, _Mapping]] = ..., chunk: _Optional[_Union[KvChunk, _Mapping]] = ..., commit: _Optional[_Union[SyncCacheCommit, _Mapping]] = ...) -> None: ...

class SyncCacheResponse(_message.Message):
    __slots__ = ("lease_id", "state", "num_chunks", "num_bytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    state: LeaseState
    num_chunks: int
    num_bytes: int
    def __init__(self, lease_id: _Optional[str] = ..., state: _Optional[_Union[LeaseState, str]] = ..., num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class KvTcpResult(_message.Message):
    __slots__ = ("response", "error_reason", "error_message")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    response: SyncCacheResponse
    error_reason: _errors_pb2.ErrorReason
    error_message: str
    def __init__(self, response: _Optional[_Union[SyncCacheResponse, _Mapping]] = ..., error_reason: _Optional[_Union[_errors_pb2.ErrorReason, str]] = ..., error_message: _Optional[str] = ...) -> None: ...

class DecodeServiceGenerateRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "resumable", "resume", "snapshot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    resumable: bool
    resume: bool
    snapshot: bool
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., resumable: _Optional[bool] = ..., resume: _Optional[bool] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("token_ids", "first_index", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., first_index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class PreemptionNotice(_message.Message):
    __slots__ = ("reason", "num_generated_tokens", "generated_token_ids", "stored_prefix_key")
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STORED_PREFIX_KEY_FIELD_NUMBER: _ClassVar[int]
    reason: PreemptionReason
    num_generated_tokens: int
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stored_prefix_key: str
    def __init__(self, reason: _Optional[_Union[PreemptionReason, str]] = ..., num_generated_tokens: _Optional[int] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., stored_prefix_key: _Optional[str] = ...) -> None: ...

class DecodeServiceGenerateResponse(_message.Message):
    __slots__ = ("tokens", "preemption", "finished")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenBatch
    preemption: PreemptionNotice
    finished: _common_pb2.Finished
    def __init__(self, tokens: _Optional[_Union[TokenBatch, _Mapping]] = ..., preemption: _Optional[_Union[PreemptionNotice, _Mapping]] = ..., finished: _Optional[_Union[_common_pb2.Finished, _Mapping]] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "request_id", "lease_token")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    request_id: str
    lease_token: bytes
    def __init__(self, lease_id: _Optional[str] = ..., request_id: _Optional[str] = ..., lease_token: _Optional[bytes] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: LeaseState
    def __init__(self, state: _Optional[_Union[LeaseState, str]] = ...) -> None: ...
