"""What a prefill instance reports about itself: identity, load, and block-pool integrity."""

from __future__ import annotations

import grpc

from pdserve.prefill.pipeline import Pipeline
from pdserve.prefill.prefill_loop import PrefillLoop
from pdserve.prefill.request import RequestStatus
from pdserve.v1 import common_pb2, instance_pb2, instance_pb2_grpc


class PrefillStatus(instance_pb2_grpc.InstanceServiceServicer):
    """Builds load reports and serves InstanceService for a prefill instance.

    Args:
        instance: This instance's InstanceInfo.
        pipeline: The requests in flight.
        loop: The engine thread (and through it the block pool).
    """

    def __init__(
        self, instance: common_pb2.InstanceInfo, pipeline: Pipeline, loop: PrefillLoop
    ) -> None:
        self.instance = instance
        self.pipeline = pipeline
        self.loop = loop

    def load_report(self) -> common_pb2.LoadReport:
        """The current load (cheap; called for every heartbeat).

        Queued: requests still preparing or waiting for a pass; running: those computing or
        shipping their KV. Queued prompt tokens count every token not yet computed.
        """
        requests = [task.request for task in self.pipeline.live.values()]
        num_preparing = sum(1 for r in requests if r.status <= RequestStatus.PREPARING)
        num_waiting = self.loop.num_waiting
        with self.loop.lock:
            pool = self.loop.scheduler.pool
            num_free, num_total = pool.num_free_blocks, pool.num_blocks
        return common_pb2.LoadReport(
            num_queued_prompt_tokens=sum(r.num_uncomputed_tokens for r in requests),
            num_queued_requests=num_preparing + num_waiting,
            num_running_requests=max(0, len(requests) - num_preparing - num_waiting),
            num_free_blocks=num_free,
            num_total_blocks=num_total,
            is_draining=self.pipeline.is_draining,
        )

    def pool_integrity(self, check: bool) -> common_pb2.PoolIntegrity:
        """Block-pool counts, and the full invariant check when `check` is set.

        A prefill leases no blocks of its own; ``num_open_leases`` counts the decode leases
        its requests hold and have not handed off or released yet.
        """
        detail = ""
        with self.loop.lock:
            if check:
                try:
                    self.loop.scheduler.check_integrity()
                except AssertionError as error:
                    detail = str(error) or "integrity check failed"
            pool = self.loop.scheduler.pool
            num_free, num_total = pool.num_free_blocks, pool.num_blocks
        return common_pb2.PoolIntegrity(
            num_total_blocks=num_total,
            num_free_blocks=num_free,
            num_open_leases=sum(1 for t in self.pipeline.live.values() if t.is_lease_open),
            is_consistent=not detail,
            detail=detail,
        )

    async def GetInstanceStatus(
        self, request: instance_pb2.GetInstanceStatusRequest, context: grpc.aio.ServicerContext
    ) -> instance_pb2.GetInstanceStatusResponse:
        """Identity, load and pool integrity of this prefill."""
        return instance_pb2.GetInstanceStatusResponse(
            instance=self.instance,
            load=self.load_report(),
            pool=self.pool_integrity(request.check_integrity),
        )
