"""What a decode instance reports about itself: identity, load, and block-pool integrity."""

from __future__ import annotations

from pdserve.decode.decode_loop import DecodeLoop
from pdserve.decode.leases import LeaseManager
from pdserve.serving.status import InstanceStatus, integrity_failure
from pdserve.v1 import common_pb2


class DecodeStatus(InstanceStatus):
    """Builds load reports and serves InstanceService for a decode instance.

    Args:
        instance: This instance's InstanceInfo.
        leases: The lease table (and through it the block pool).
        loop: The decode thread.
    """

    def __init__(
        self, instance: common_pb2.InstanceInfo, leases: LeaseManager, loop: DecodeLoop
    ) -> None:
        super().__init__(instance)
        self.leases = leases
        self.loop = loop

    def load_report(self) -> common_pb2.LoadReport:
        with self.leases.table.lock:
            return common_pb2.LoadReport(
                num_queued_requests=self.loop.num_waiting,
                num_running_requests=self.loop.num_running,
                num_free_blocks=self.leases.table.pool.num_free_blocks,
                num_total_blocks=self.leases.table.pool.num_blocks,
                num_leased_blocks=self.leases.table.num_leased_blocks(),
                num_reserved_blocks=self.leases.num_reserved_blocks(),
                is_draining=self.leases.is_draining,
            )

    def pool_integrity(self, check: bool) -> common_pb2.PoolIntegrity:
        detail = integrity_failure(self.leases.table.check_integrity) if check else ""
        with self.leases.table.lock:
            return common_pb2.PoolIntegrity(
                num_total_blocks=self.leases.table.pool.num_blocks,
                num_free_blocks=self.leases.table.pool.num_free_blocks,
                num_cached_blocks=self.leases.table.pool.num_cached_blocks,
                num_leased_blocks=self.leases.table.num_leased_blocks(),
                num_open_leases=len(self.leases.table.open_leases()),
                is_consistent=not detail,
                detail=detail,
            )
