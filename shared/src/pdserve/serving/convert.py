"""Conversions between pdserve.v1 messages and the engine's plain dataclasses."""

from __future__ import annotations

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.protocol import FEATURES, PROTOCOL_VERSION, kv_layout_fingerprint
from pdserve.engine.kv_cache import KVCacheLayout
from pdserve.engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2

_KV_DTYPES = {
    "float32": common_pb2.KV_DTYPE_FLOAT32,
    "float16": common_pb2.KV_DTYPE_FLOAT16,
    "bfloat16": common_pb2.KV_DTYPE_BFLOAT16,
}
MAX_SEED = 2**63


def local_protocol() -> common_pb2.Protocol:
    """This implementation's Protocol message."""
    return common_pb2.Protocol(version=PROTOCOL_VERSION, features=list(FEATURES))


def kv_layout_to_proto(layout: KVCacheLayout, model_id: str) -> common_pb2.KvLayout:
    """The KvLayout message (with its fingerprint) of an engine cache layout."""
    dtype = _KV_DTYPES[layout.dtype]
    return common_pb2.KvLayout(
        model_id=model_id,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=dtype,
        block_size=layout.block_size,
        fingerprint=kv_layout_fingerprint(
            model_id,
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            common_pb2.KvDtype.Name(dtype),
            layout.block_size,
        ),
    )


def sampling_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Engine sampling params from the contract's, validated.

    Raises:
        PdserveError: INVALID_REQUEST for out-of-range values.
    """
    seed = message.seed if message.HasField("seed") else None
    try:
        return SamplingParams(
            temperature=message.temperature if message.HasField("temperature") else 1.0,
            top_k=message.top_k if message.HasField("top_k") else 0,
            top_p=message.top_p if message.HasField("top_p") else 1.0,
            # NOTE: the contract allows any uint64; the engine's generator takes 63 bits.
            seed=None if seed is None else seed % MAX_SEED,
            max_tokens=message.max_tokens,
            stop_token_ids=tuple(message.stop_token_ids),
            ignore_eos=message.ignore_eos,
        )
    except ValueError as error:
        raise PdserveError(ErrorReason.INVALID_REQUEST, str(error)) from None


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The contract's sampling params from the engine's."""
    message = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        message.seed = params.seed
    return message
