"""Polls statically configured instances (--prefill / --decode) for health and load.

Each poll checks grpc.health.v1 and calls InstanceService.GetInstanceStatus; a success
(re-)registers the instance in the registry under the configured address, a failure marks it
unreachable. An instance that comes back with a new id (it restarted) replaces its old entry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import structlog

from pdserve.common.errors import PdserveError
from pdserve.gateway.fleet.backend import BackendError
from pdserve.gateway.fleet.instance import InstanceInfo, InstanceRole, LoadReport
from pdserve.gateway.fleet.registry import Registry

log = structlog.get_logger("pdserve.gateway.fleet.poller")

GetStatus = Callable[[str, float], Awaitable[tuple[InstanceInfo, LoadReport]]]
IsServing = Callable[[str, float], Awaitable[bool]]


@dataclass(eq=False)
class StaticPoller:
    """Keeps static instances in the registry.

    Args:
        registry: Where polled instances go.
        targets: (address, expected role) of every static instance.
        get_status: InstanceService.GetInstanceStatus by address.
        is_serving: grpc health check by address.
        interval_s: Seconds between polls.
    """

    registry: Registry
    targets: list[tuple[str, InstanceRole]]
    get_status: GetStatus
    is_serving: IsServing
    interval_s: float
    _ids_by_address: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    async def poll_once(self) -> None:
        """Polls every target once, concurrently."""
        await asyncio.gather(*(self._poll(address, role) for address, role in self.targets))

    async def run(self) -> None:
        """Polls forever (cancel the task to stop)."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    async def _poll(self, address: str, role: InstanceRole) -> None:
        timeout_s = max(0.5, self.interval_s)
        known_id = self._ids_by_address.get(address)
        try:
            if not await self.is_serving(address, timeout_s):
                raise ConnectionError("health check is not SERVING")
            info, load = await self.get_status(address, timeout_s)
            if info.role is not role:
                raise ValueError(
                    f"instance reports role {info.role.value}, configured as {role.value}"
                )
            info = replace(info, address=address)
            if known_id is not None and known_id != info.instance_id:
                self.registry.remove_all([known_id])
            self.registry.register(info, load, is_static=True)
            self._ids_by_address[address] = info.instance_id
        except (BackendError, PdserveError, ConnectionError, ValueError) as exc:
            if known_id is not None:
                self.registry.mark_unreachable(known_id)
            log.debug(
                "static_instance_poll_failed", address=address, role=role.value, error=str(exc)
            )
