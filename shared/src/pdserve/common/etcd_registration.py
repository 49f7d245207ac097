"""Keeps a key alive in the shared etcd under a lease of its own: a prefill or decode
instance's registration, or a gateway's word that it still runs its resumable requests.

`EtcdLeasedKey` grants an etcd lease of the TTL, puts the key under it, and every interval
keeps the lease alive and puts the value again. While etcd is unreachable it keeps retrying
with capped backoff on a new connection each time, with the same lease: a lease that survived
(etcd restarted within the TTL) is kept, one that lapsed is replaced and the key put again.
`stop()` puts the value a last time and revokes the lease, which deletes the key at once.

`EtcdRegistrationClient` has the shape of `pdserve.common.registration.RegistrationClient`
(``run``, ``stop``, ``is_registered``) for ``--registry etcd://...``: its key is the instance's
(`pdserve.common.etcd_registry`), its value the instance with a fresh load report.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable

import aetcd

from pdserve.common.etcd_registry import EtcdTarget
from pdserve.common.logging import get_logger
from pdserve.v1 import common_pb2, registry_pb2

log = get_logger(__name__)

MAX_BACKOFF_S = 5.0
STOP_TIMEOUT_S = 2.0


class EtcdLeasedKey:
    """Keeps `key` in etcd under a lease of its own, with `value()` put at every keep-alive.

    Args:
        target: The etcd.
        key: The key.
        value: Called before every put for the value.
        ttl_s: Lease TTL (etcd counts whole seconds: rounded up; etcd may raise a TTL below
            its own minimum, about 2 s with default settings).
        interval_s: Seconds between keep-alives.
        fields: What the log lines say the key is for (e.g. ``instance_id=...``).
    """

    def __init__(
        self,
        target: EtcdTarget,
        key: bytes,
        value: Callable[[], bytes],
        ttl_s: float,
        interval_s: float,
        fields: dict[str, str],
    ) -> None:
        self.target = target
        self.key = key
        self.value = value
        self.ttl_s = max(1, math.ceil(ttl_s))
        self.interval_s = interval_s
        self.fields = fields
        self.num_registrations = 0
        self.is_registered = asyncio.Event()
        self._lease_id: int | None = None
        self._client: aetcd.Client | None = None
        self._stopping = asyncio.Event()
        # NOTE: retry well within the TTL, so a lease that survived an etcd restart is kept.
        self._max_backoff_s = min(MAX_BACKOFF_S, max(interval_s, self.ttl_s / 3))

    async def run(self) -> None:
        """Registers and refreshes until `stop()`; never raises for etcd trouble."""
        backoff_s = self.interval_s
        is_failing = False
        while not self._stopping.is_set():
            try:
                if self._lease_id is None:
                    await self._register()
                else:
                    await self._refresh()
                backoff_s = self.interval_s
                is_failing = False
                await self._sleep(self.interval_s)
            except (aetcd.ClientError, TimeoutError) as error:
                if not is_failing:  # NOTE: once per outage, not once per retry
                    is_failing = True
                    log.warning(
                        "registration_failed",
                        registry=self.target.describe(),
                        error=type(error).__name__,
                        detail=str(error),
                    )
                self.is_registered.clear()
                # NOTE: a new connection each time: a gRPC channel to a restarted etcd may
                # otherwise sit in its own reconnect backoff for far longer than the lease TTL.
                await self._close_client()
                await self._sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self._max_backoff_s)

    async def stop(self) -> None:
        """Announces the leave, then revokes the lease (deleting the key: deregistration, best
        effort); ends `run()`.

        The last value written is `value()` as it stands (an instance's says draining:
        gateways tell a leave from a lapsed lease, a loss whose streams they move at once, by
        it).
        """
        self._stopping.set()
        if self._lease_id is not None:
            try:
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await self._etcd().put(self.key, self.value(), lease=self._lease_id)
                    await self._etcd().revoke_lease(self._lease_id)
                log.info("deregistered", **self.fields)
            except (aetcd.ClientError, TimeoutError) as error:
                log.warning("deregister_failed", error=type(error).__name__, detail=str(error))
            self._lease_id = None
        self.is_registered.clear()
        await self._close_client()

    def _etcd(self) -> aetcd.Client:
        if self._client is None:
            self._client = self.target.client()
        return self._client

    async def _register(self) -> None:
        if self._stopping.is_set():
            return  # NOTE: stop() may have revoked the lease a refresh was just renewing.
        etcd = self._etcd()
        lease = await etcd.lease(self.ttl_s)
        self._lease_id = lease.id
        await etcd.put(self.key, self.value(), lease=lease.id)
        self.num_registrations += 1
        self.is_registered.set()
        log.info(
            "registered",
            registry=self.target.describe(),
            **self.fields,
            key=self.key.decode(),
            ttl_s=self.ttl_s,
            heartbeat_interval_ms=round(self.interval_s * 1000),
        )

    async def _refresh(self) -> None:
        assert self._lease_id is not None
        etcd = self._etcd()
        reply = await etcd.refresh_lease(self._lease_id)
        if reply is None or reply.TTL <= 0:
            # NOTE: the lease lapsed (etcd was away longer than the TTL): its key is gone.
            log.info("registration_lost", **self.fields)
            self._lease_id = None
            self.is_registered.clear()
            await self._register()
            return
        await etcd.put(self.key, self.value(), lease=self._lease_id)
        if not self.is_registered.is_set():
            self.is_registered.set()
            log.info("registration_restored", **self.fields)

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)


class EtcdRegistrationClient(EtcdLeasedKey):
    """Registers `instance` in etcd under a lease and refreshes its load.

    Args:
        target: The etcd registry.
        instance: What to register (identity, address, protocol, KV layout).
        load_report: Called before every put for the current load.
        ttl_s: Lease TTL (see `EtcdLeasedKey`).
        interval_s: Seconds between keep-alives (each with a fresh load report).
    """

    def __init__(
        self,
        target: EtcdTarget,
        instance: common_pb2.InstanceInfo,
        load_report: Callable[[], common_pb2.LoadReport],
        ttl_s: float,
        interval_s: float,
    ) -> None:
        self.instance = instance
        self.load_report = load_report
        role = common_pb2.InstanceRole.Name(instance.role).removeprefix("INSTANCE_ROLE_").lower()
        key = target.instance_key(role, instance.instance_id)
        fields = {"instance_id": instance.instance_id}
        super().__init__(target, key, self._value, ttl_s, interval_s, fields)

    def _value(self) -> bytes:
        return registry_pb2.RegisterRequest(
            instance=self.instance, load=self.load_report()
        ).SerializeToString()
