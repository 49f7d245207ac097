"""The cuda_ipc KV channel: the decode's cache mapped into this prefill (CUDA IPC on a GPU,
its CPU stand-in in tests), the lease's blocks copied into it device to device.

The mapping is opened once per decode (`MappedCaches`); a handle that cannot be opened raises
`TransportUnavailable`, so the sender falls back to the next transport. Writes, checksums and
commit are those of the shared-memory channel (`InPlaceChannel`); the copies of a group of
pieces are queued on a side stream and announced once they landed. When the channel closes,
the mappings of decodes that stopped are closed too.
"""

from __future__ import annotations

from pdserve.kv.transports.cuda_ipc import CacheHandle, CacheUnavailable
from pdserve.kv.transports.cuda_ipc_window import CacheWindow, MappedCaches
from pdserve.prefill.kv.channels import InPlaceChannel, TransportUnavailable
from pdserve.prefill.request import Request
from pdserve.v1 import decode_pb2_grpc


class CudaIpcChannel(InPlaceChannel):
    """SyncCache whose chunks are copied into the decode's mapped cache.

    Args:
        stub: The decode's stub.
        request: The request (holding its lease; its blocks hold the KV in the source cache).
        caches: This prefill's mappings and its own cache (the source).
        handle: The lease's cuda_ipc cache handle.
    """

    name = "cuda_ipc"

    def __init__(
        self,
        stub: decode_pb2_grpc.DecodeServiceStub,
        request: Request,
        caches: MappedCaches,
        handle: CacheHandle,
    ) -> None:
        super().__init__(stub, request)
        self.caches = caches
        self.handle = handle
        self.cache_window: CacheWindow | None = None

    def _open_writer(self) -> CacheWindow:
        lease = self.request.lease
        assert lease is not None
        try:
            cache = self.caches.open(self.handle)
            self.cache_window = cache.window(
                lease.block_ids, lease.num_shared_blocks, self.caches.source
            )
        except (CacheUnavailable, ValueError) as error:
            raise TransportUnavailable(
                f"cache of process {self.handle.process_id}: {error}"
            ) from None
        return self.cache_window

    def _wait_landed(self) -> None:
        assert self.cache_window is not None
        self.cache_window.wait()

    def close(self) -> None:
        super().close()
        self.caches.close_lost()
