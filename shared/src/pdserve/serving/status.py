"""InstanceService for a prefill or decode: identity, load report and block-pool integrity."""

from __future__ import annotations

import abc
from collections.abc import Callable

import grpc

from pdserve.v1 import common_pb2, instance_pb2, instance_pb2_grpc


class InstanceStatus(instance_pb2_grpc.InstanceServiceServicer, abc.ABC):
    """What an instance reports about itself; each role says how to read its load and pool.

    The same `load_report` feeds heartbeats, ``/metrics`` gauges and GetInstanceStatus.

    Args:
        instance: This instance's InstanceInfo (its ``metrics_address`` is filled in once the
            metrics endpoint is up).

    Attributes:
        is_insecure: Whether the internal plane runs without mTLS (reported to callers).
        attention_backend: What attention the engine runs (``sdpa``, ``flash-attn-4``, ...).
    """

    def __init__(self, instance: common_pb2.InstanceInfo) -> None:
        self.instance = instance
        self.is_insecure = False
        self.attention_backend = ""

    @abc.abstractmethod
    def load_report(self) -> common_pb2.LoadReport:
        """The current load (cheap; called for every heartbeat and scrape)."""

    @abc.abstractmethod
    def pool_integrity(self, check: bool) -> common_pb2.PoolIntegrity:
        """Block-pool counts, and the full invariant check when `check` is set."""

    async def GetInstanceStatus(
        self, request: instance_pb2.GetInstanceStatusRequest, context: grpc.aio.ServicerContext
    ) -> instance_pb2.GetInstanceStatusResponse:
        """Identity, load and pool integrity of this instance."""
        return instance_pb2.GetInstanceStatusResponse(
            instance=self.instance,
            load=self.load_report(),
            pool=self.pool_integrity(request.check_integrity),
            insecure=self.is_insecure,
            attention_backend=self.attention_backend,
        )


def integrity_failure(check_integrity: Callable[[], None]) -> str:
    """Runs an invariant check: "" when it holds, else what failed (for `PoolIntegrity`)."""
    try:
        check_integrity()
    except AssertionError as error:
        return str(error) or "integrity check failed"
    return ""
