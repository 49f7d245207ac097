"""What a prefill instance reports about itself: identity, load, and block-pool integrity."""

from __future__ import annotations

from pdserve.prefill.handoff import Handoffs
from pdserve.prefill.prefill_loop import PrefillLoop
from pdserve.prefill.request import RequestStatus
from pdserve.serving.status import InstanceStatus, integrity_failure
from pdserve.v1 import common_pb2


class PrefillStatus(InstanceStatus):
    """Builds load reports and serves InstanceService for a prefill instance.

    Args:
        instance: This instance's InstanceInfo.
        handoffs: The requests in flight.
        loop: The engine thread (and through it the block pool).
    """

    def __init__(
        self, instance: common_pb2.InstanceInfo, handoffs: Handoffs, loop: PrefillLoop
    ) -> None:
        super().__init__(instance)
        self.handoffs = handoffs
        self.loop = loop

    def load_report(self) -> common_pb2.LoadReport:
        """The current load. Queued: requests still preparing or waiting for a pass; running:
        those computing or shipping their KV. Queued prompt tokens count every token not yet
        computed.
        """
        requests = [flight.request for flight in self.handoffs.live.values()]
        num_preparing = sum(1 for r in requests if r.status <= RequestStatus.PREPARING)
        num_waiting = self.loop.num_waiting
        with self.loop.lock:
            pool = self.loop.scheduler.pool
            num_free, num_total = pool.num_free_blocks, pool.num_blocks
        max_cached = pool.max_cached_free_blocks if pool.enable_prefix_caching else 0
        return common_pb2.LoadReport(
            num_queued_prompt_tokens=sum(r.num_uncomputed_tokens for r in requests),
            num_queued_requests=num_preparing + num_waiting,
            num_running_requests=max(0, len(requests) - num_preparing - num_waiting),
            num_free_blocks=num_free,
            num_total_blocks=num_total,
            is_draining=self.handoffs.is_draining,
            max_cached_blocks=max_cached,
        )

    def pool_integrity(self, check: bool) -> common_pb2.PoolIntegrity:
        """Block-pool counts. A prefill leases no blocks of its own: ``num_open_leases``
        counts the decode leases its requests hold and have not handed off or released yet.
        Free blocks include evictable prefix-cache blocks (also in ``num_cached_blocks``).
        """
        with self.loop.lock:
            detail = integrity_failure(self.loop.scheduler.check_integrity) if check else ""
            pool = self.loop.scheduler.pool
            num_free, num_total = pool.num_free_blocks, pool.num_blocks
            num_cached = pool.num_cached_blocks
        return common_pb2.PoolIntegrity(
            num_total_blocks=num_total,
            num_free_blocks=num_free,
            num_cached_blocks=num_cached,
            num_open_leases=sum(
                1 for flight in self.handoffs.live.values() if flight.request.is_lease_open
            ),
            is_consistent=not detail,
            detail=detail,
        )
