"""RegistryService: prefill and decode instances join, report load and leave.

With mTLS (the gateway's internal port) an instance may only speak for itself: the instance
id and role it registers, heartbeats or deregisters must be the ones in its certificate, so
no instance can register as, keep alive, or remove another. Refusals are PERMISSION_DENIED.
"""

from __future__ import annotations

import grpc

from pdserve.common.authz import peer_identity
from pdserve.common.errors import ErrorReason, PdserveError, abort_with_error
from pdserve.gateway.fleet import convert
from pdserve.gateway.fleet.registry import Registry
from pdserve.v1 import registry_pb2, registry_pb2_grpc


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    """Serves RegistryService on a `Registry`.

    Args:
        registry: Where instances are kept.
        heartbeat_interval_s: Interval asked of instances.
    """

    def __init__(self, registry: Registry, heartbeat_interval_s: float) -> None:
        self._registry = registry
        self._heartbeat_interval_ms = round(heartbeat_interval_s * 1000)

    async def Register(
        self, request: registry_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RegisterResponse:
        """Adds or replaces an instance.

        Fails with INCOMPATIBLE_PEER for another protocol major and INVALID_REQUEST for an
        incomplete instance description (missing id, address, model or role; a KV layout
        fingerprint that does not match its fields).
        """
        try:
            info = convert.instance_info_from_pb(request.instance)
            check_speaks_for(context, info.instance_id, info.role.value)
            self._registry.register(info, convert.load_from_pb(request.load))
        except PdserveError as error:
            await abort_with_error(context, error)
        return registry_pb2.RegisterResponse(
            heartbeat_interval_ms=self._heartbeat_interval_ms,
            instance_ttl_ms=round(self._registry.ttl_s * 1000),
            protocol=convert.local_protocol(),
        )

    async def Heartbeat(
        self, request: registry_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatResponse:
        """Records load; INSTANCE_NOT_REGISTERED for an unknown id (the instance re-registers)."""
        try:
            check_speaks_for(context, request.instance_id)
            self._registry.heartbeat(request.instance_id, convert.load_from_pb(request.load))
        except PdserveError as error:
            await abort_with_error(context, error)
        return registry_pb2.HeartbeatResponse(heartbeat_interval_ms=self._heartbeat_interval_ms)

    async def Deregister(
        self, request: registry_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.DeregisterResponse:
        """Removes an instance. Idempotent."""
        try:
            check_speaks_for(context, request.instance_id)
        except PdserveError as error:
            await abort_with_error(context, error)
        self._registry.deregister(request.instance_id)
        return registry_pb2.DeregisterResponse()


def check_speaks_for(
    context: grpc.aio.ServicerContext, instance_id: str, role: str | None = None
) -> None:
    """Refuses a caller whose certificate names another instance (or role); a plaintext
    (``--insecure``) plane has no identities and trusts every caller.

    Raises:
        PdserveError: PERMISSION_DENIED.
    """
    identity = peer_identity(context)
    if identity is None:
        return
    if identity.instance_id != instance_id or (role is not None and identity.role != role):
        raise PdserveError(
            ErrorReason.PERMISSION_DENIED,
            f"{identity} may not speak for instance {instance_id!r}"
            + (f" as a {role}" if role is not None else ""),
            {"instanceId": instance_id},
        )
