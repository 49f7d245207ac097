"""Which channels a transfer may use: the decode's offers, in this prefill's order.

The decode lists what it offers besides gRPC SyncCache (always available) in the lease;
`--kv-transports` says which of them this prefill may use and in what order (by default the
copies within one host first, cuda_ipc and shm, then nixl where both ends have it: this
prefill's agent started and the decode offers its agent; on one CPU host shm is faster).
cuda_ipc is tried only when the decode's cache handle names this host and this prefill's device
kind (shared memory needs the same host too: its segment is not found elsewhere). The sender
opens the first that works (`KvSender`), so listing one transport forces it: a transfer then
fails rather than falling back.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.kv.transports.cuda_ipc_window import MappedCaches
from pdserve.prefill.kv.channels import GrpcChannel, KvChannel
from pdserve.prefill.kv.cuda_ipc import CudaIpcChannel
from pdserve.prefill.kv.nixl import NixlChannel, NixlSide
from pdserve.prefill.kv.shm import SharedMemoryChannel, SharedPools
from pdserve.prefill.kv.tcp import TcpChannel
from pdserve.prefill.request import Request
from pdserve.v1 import decode_pb2_grpc

KV_TRANSPORTS = ("nixl", "cuda_ipc", "shm", "tcp", "grpc")


def channels_for(
    request: Request,
    stub: decode_pb2_grpc.DecodeServiceStub,
    pools: SharedPools,
    preference: Sequence[str],
    caches: MappedCaches | None = None,
    nixl: NixlSide | None = None,
) -> list[KvChannel]:
    """The channels `request`'s transfer may try, in order: each transport of `preference`
    that its lease offers (gRPC always; cuda_ipc where `caches` can map the decode's cache;
    nixl where this prefill has an agent, `nixl`).

    Raises:
        PdserveError: INCOMPATIBLE_PEER when the decode offers none of them.
    """
    assert request.lease is not None
    offers = {offer.kind: offer.address for offer in request.lease.transports}
    handle = next((o.handle for o in request.lease.transports if o.kind == "cuda_ipc"), None)
    target = next((o.nixl for o in request.lease.transports if o.kind == "nixl"), None)
    channels: list[KvChannel] = []
    for kind in preference:
        if kind == "nixl":
            if target is not None and nixl is not None:
                channels.append(NixlChannel(stub, request, nixl, target))
        elif kind == "cuda_ipc":
            if handle is not None and caches is not None and caches.can_map(handle):
                channels.append(CudaIpcChannel(stub, request, caches, handle))
        elif kind == "grpc":
            channels.append(GrpcChannel(stub, request))
        elif kind == "shm" and "shm" in offers:
            channels.append(SharedMemoryChannel(stub, request, pools.open, offers["shm"]))
        elif kind == "tcp" and "tcp" in offers:
            channels.append(TcpChannel(stub, request, offers["tcp"]))
    if not channels:
        raise PdserveError(
            ErrorReason.INCOMPATIBLE_PEER,
            f"the decode offers none of the KV transports {', '.join(preference)} "
            f"(it offers {', '.join([*offers, 'grpc'])})",
            {"requestId": request.request_id, "decodeAddress": request.decode_address},
        )
    return channels
