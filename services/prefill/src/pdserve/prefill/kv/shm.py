"""The shared-memory KV channel: the decode's KV cache is a segment on this host, mapped once
per decode (`SharedPools`); the lease's blocks are written into it in place, with the writes,
checksums and commit of every in-place channel (`pdserve.prefill.kv.channels.InPlaceChannel`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.engine.kv_cache import KVCacheLayout
from pdserve.kv.transports.shm import LeaseWindow, SharedKvPool
from pdserve.prefill.kv.channels import InPlaceChannel, TransportUnavailable
from pdserve.prefill.request import Request
from pdserve.v1 import decode_pb2_grpc


class SharedMemoryChannel(InPlaceChannel):
    """SyncCache whose chunks are written into the decode's shared-memory KV cache.

    Args:
        stub: The decode's stub.
        request: The request (holding its lease).
        open_pool: Maps the decode's segment (by name, and the slots of its window storage)
            or returns the mapping already open.
        segment_name: The lease's shared-memory address.
    """

    name = "shm"

    def __init__(
        self,
        stub: decode_pb2_grpc.DecodeServiceStub,
        request: Request,
        open_pool: Callable[[str, int], SharedKvPool],
        segment_name: str,
    ) -> None:
        super().__init__(stub, request)
        self.open_pool = open_pool
        self.segment_name = segment_name

    def _open_writer(self) -> LeaseWindow:
        assert self.request.lease is not None
        try:
            lease = self.request.lease
            pool = self.open_pool(self.segment_name, lease.num_window_slots)
            return pool.window(
                lease.block_ids,
                lease.num_shared_blocks,
                lease.num_window_skipped_blocks,
                lease.window_slot_ids,
            )
        except (OSError, ValueError) as error:
            raise TransportUnavailable(f"segment {self.segment_name}: {error}") from None


class SharedPools:
    """The decodes' segments this prefill mapped, by name; a mapping whose segment is gone
    (its decode stopped) is dropped when the next one is opened.

    Args:
        layout: The KV layout (the decodes' fingerprints equal the prefill's).
        window_layers: The model's sliding-window layers (a decode may keep them in window
            storage after its blocks).
    """

    def __init__(self, layout: KVCacheLayout, window_layers: Sequence[int] = ()) -> None:
        self.layout = layout
        self.window_layers = tuple(window_layers)
        self._pools: dict[str, SharedKvPool] = {}

    def open(self, name: str, num_window_slots: int = 0) -> SharedKvPool:
        """The mapping of segment `name` (mapped on first use), whose sliding layers have
        `num_window_slots` slots of window storage (0: none).

        Raises:
            OSError, ValueError: As `SharedKvPool`.
        """
        pool = self._pools.get(name)
        if pool is None:
            for stale in [n for n, p in self._pools.items() if not p.exists()]:
                del self._pools[stale]
            pool = self._pools[name] = SharedKvPool(
                name,
                self.layout,
                window_layers=self.window_layers,
                num_window_slots=num_window_slots,
            )
        return pool
