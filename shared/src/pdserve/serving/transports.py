"""A decode's KV transport offers as a Lease's `Transport` messages carry them, both ways: the
decode writes them (`transport_to_proto`), the prefill reads them (`transport_from_proto`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from pdserve.kv.transports.cuda_ipc import CacheHandle
from pdserve.kv.transports.nixl import NixlTarget
from pdserve.kv.transports.offer import TransportOffer
from pdserve.v1 import decode_pb2

# The contract's kinds by the names the flags, logs and offers use.
TRANSPORT_KINDS = {
    "grpc": decode_pb2.TRANSPORT_KIND_GRPC_SYNC_CACHE,
    "cuda_ipc": decode_pb2.TRANSPORT_KIND_CUDA_IPC,
    "shm": decode_pb2.TRANSPORT_KIND_SHARED_MEMORY,
    "tcp": decode_pb2.TRANSPORT_KIND_TCP,
    "nixl": decode_pb2.TRANSPORT_KIND_NIXL,
}
_OFFER_NAMES = {kind: name for name, kind in TRANSPORT_KINDS.items() if name != "grpc"}


def transport_to_proto(
    offer: TransportOffer,
    token: bytes,
    block_ids: Sequence[int],
    window_slot_ids: Sequence[int] = (),
) -> decode_pb2.Transport:
    """The Transport message of `offer` in a lease of `block_ids` with its `token` (a decode's
    NIXL offer names every block of its cache, and every window slot; a lease only its own:
    its blocks, and the `window_slot_ids` of those that hold one)."""
    nixl = (
        None
        if offer.nixl is None
        else _nixl_target_to_proto(offer.nixl.for_blocks(block_ids, window_slot_ids))
    )
    return decode_pb2.Transport(
        kind=TRANSPORT_KINDS[offer.kind],
        address=offer.address,
        token=token,
        cache_handle=None if offer.handle is None else _cache_handle_to_proto(offer.handle),
        nixl=nixl,
    )


def transport_from_proto(transport: decode_pb2.Transport) -> TransportOffer | None:
    """The offer a Transport message makes (None for gRPC SyncCache, which every decode
    accepts, and for kinds this build does not know)."""
    name = _OFFER_NAMES.get(transport.kind)
    if name is None:
        return None
    handle = transport.cache_handle if transport.HasField("cache_handle") else None
    nixl = transport.nixl if transport.HasField("nixl") else None
    return TransportOffer(
        name,
        transport.address,
        None if handle is None else _cache_handle_from_proto(handle),
        None if nixl is None else _nixl_target_from_proto(nixl),
    )


def _cache_handle_to_proto(handle: CacheHandle) -> decode_pb2.KvCacheHandle:
    return decode_pb2.KvCacheHandle(**_fields_of(handle))


def _cache_handle_from_proto(handle: decode_pb2.KvCacheHandle) -> CacheHandle:
    return CacheHandle(**{field.name: getattr(handle, field.name) for field in fields(CacheHandle)})


def _nixl_target_to_proto(target: NixlTarget) -> decode_pb2.NixlTarget:
    return decode_pb2.NixlTarget(**_fields_of(target))


def _nixl_target_from_proto(target: decode_pb2.NixlTarget) -> NixlTarget:
    values = {field.name: getattr(target, field.name) for field in fields(NixlTarget)}
    repeated = ("block_addresses", "window_layers", "window_block_addresses")
    return NixlTarget(**{**values, **{name: tuple(getattr(target, name)) for name in repeated}})


def _fields_of(value: CacheHandle | NixlTarget) -> dict[str, Any]:
    # NOTE: the dataclasses are their messages field for field (tests/unit/serving).
    return {field.name: getattr(value, field.name) for field in fields(value)}
