"""A decode's transport offers through a Lease's Transport messages and back."""

from __future__ import annotations

from dataclasses import fields

import pytest

from pdserve.kv.transports.cuda_ipc import CacheHandle
from pdserve.kv.transports.nixl import NixlTarget
from pdserve.kv.transports.offer import TransportOffer
from pdserve.serving.transports import TRANSPORT_KINDS, transport_from_proto, transport_to_proto
from pdserve.v1 import decode_pb2

HANDLE = CacheHandle("boot-1", 4242, "cuda:H200", b"\x01" * 64, 1, 4096, 1 << 30, b"/ref", 8)
TARGET = NixlTarget(
    agent_metadata=b"meta",
    agent_name="decode-agent",
    memory_kind="DRAM",
    device_id=0,
    block_addresses=tuple(range(1000, 1010)),
    layer_stride_bytes=4096,
    kv_stride_bytes=2048,
    block_nbytes=64,
)


@pytest.mark.parametrize(
    ("dataclass", "message"),
    [(CacheHandle, decode_pb2.KvCacheHandle), (NixlTarget, decode_pb2.NixlTarget)],
)
def test_each_dataclass_is_its_message_field_for_field(dataclass: type, message: type) -> None:
    assert {f.name for f in fields(dataclass)} == set(message.DESCRIPTOR.fields_by_name)


@pytest.mark.parametrize(
    "offer",
    [
        TransportOffer("shm", "pdserve-kv-1-abc"),
        TransportOffer("tcp", "127.0.0.1:5000"),
        TransportOffer("cuda_ipc", "", HANDLE),
    ],
)
def test_an_offer_comes_back_as_it_was_sent(offer: TransportOffer) -> None:
    message = transport_to_proto(offer, b"token", [3, 4])
    assert message.token == b"token"
    assert message.kind == TRANSPORT_KINDS[offer.kind]
    assert transport_from_proto(message) == offer


def test_a_nixl_offer_names_only_the_leased_blocks() -> None:
    message = transport_to_proto(TransportOffer("nixl", "", nixl=TARGET), b"t", [2, 5])
    offer = transport_from_proto(message)
    assert offer is not None and offer.nixl is not None
    assert offer.nixl.block_addresses == (1002, 1005)
    assert offer.nixl == TARGET.for_blocks([2, 5])


def test_grpc_and_unknown_kinds_are_no_offer() -> None:
    grpc = decode_pb2.Transport(kind=decode_pb2.TRANSPORT_KIND_GRPC_SYNC_CACHE, token=b"t")
    assert transport_from_proto(grpc) is None
    assert transport_from_proto(decode_pb2.Transport(kind=999)) is None  # a newer decode's
