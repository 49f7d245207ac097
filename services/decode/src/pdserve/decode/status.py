"""What a decode instance reports about itself: identity, load, and block-pool integrity."""

from __future__ import annotations

import grpc

from pdserve.decode.decode_loop import DecodeLoop
from pdserve.decode.leases import LeaseManager
from pdserve.v1 import common_pb2, instance_pb2, instance_pb2_grpc


class DecodeStatus(instance_pb2_grpc.InstanceServiceServicer):
    """Builds load reports and serves InstanceService for a decode instance.

    Args:
        instance: This instance's InstanceInfo.
        leases: The lease table (and through it the block pool).
        loop: The decode thread.
    """

    def __init__(
        self, instance: common_pb2.InstanceInfo, leases: LeaseManager, loop: DecodeLoop
    ) -> None:
        self.instance = instance
        self.leases = leases
        self.loop = loop

    def load_report(self) -> common_pb2.LoadReport:
        """The current load (cheap; called for every heartbeat)."""
        with self.leases.lock:
            return common_pb2.LoadReport(
                num_queued_requests=self.loop.num_waiting,
                num_running_requests=self.loop.num_running,
                num_free_blocks=self.leases.pool.num_free_blocks,
                num_total_blocks=self.leases.pool.num_blocks,
                num_leased_blocks=self.leases.num_leased_blocks(),
                num_reserved_blocks=self.leases.num_reserved_blocks(),
                is_draining=self.leases.is_draining,
            )

    def pool_integrity(self, check: bool) -> common_pb2.PoolIntegrity:
        """Block-pool counts, and the full invariant check when `check` is set."""
        detail = ""
        if check:
            try:
                self.leases.check_integrity()
            except AssertionError as error:
                detail = str(error) or "integrity check failed"
        with self.leases.lock:
            return common_pb2.PoolIntegrity(
                num_total_blocks=self.leases.pool.num_blocks,
                num_free_blocks=self.leases.pool.num_free_blocks,
                num_leased_blocks=self.leases.num_leased_blocks(),
                num_open_leases=len(self.leases.open_leases()),
                is_consistent=not detail,
                detail=detail,
            )

    async def GetInstanceStatus(
        self, request: instance_pb2.GetInstanceStatusRequest, context: grpc.aio.ServicerContext
    ) -> instance_pb2.GetInstanceStatusResponse:
        """Identity, load and pool integrity of this decode."""
        return instance_pb2.GetInstanceStatusResponse(
            instance=self.instance,
            load=self.load_report(),
            pool=self.pool_integrity(request.check_integrity),
        )
