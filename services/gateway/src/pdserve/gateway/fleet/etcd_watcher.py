"""Feeds the gateway's registry from the shared etcd registry (``--registry etcd://...``).

`EtcdWatcher.run()` lists every instance key under the prefix, then watches the prefix from
the listing's revision: a put registers the instance or records its new load (a heartbeat),
a delete (the instance stopped, or its lease lapsed) removes it. Every gateway doing this sees
the same instances.

While etcd cannot be reached (restarting, partitioned) the watcher keeps the last view: it
counts the instances it knows as heard from, so neither the TTL sweep nor routing drops
instances that are probably fine, and reconnects with capped backoff. A reconnect lists
again and removes what was deleted meanwhile. A stream that silently stops (a frozen etcd)
is caught by a status probe every interval.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aetcd
import structlog

from pdserve.common.errors import PdserveError
from pdserve.common.etcd_registry import EtcdTarget
from pdserve.gateway.fleet import convert
from pdserve.gateway.fleet.registry import Registry

log = structlog.get_logger("pdserve.gateway.fleet.etcd_watcher")

MAX_BACKOFF_S = 2.0
PROBE_TIMEOUT_S = 1.0


class EtcdWatcher:
    """Mirrors the instances in etcd into `registry`.

    Args:
        registry: The gateway's registry.
        target: The etcd registry.
        interval_s: Seconds between status probes, and between holds of the last view while
            etcd is away (keep it well below the registry's TTL).
    """

    def __init__(self, registry: Registry, target: EtcdTarget, interval_s: float) -> None:
        self._registry = registry
        self._target = target
        self._interval_s = interval_s
        self._prefix = target.prefix.encode()
        self.instance_ids: set[str] = set()
        self.is_synced = False

    async def run(self) -> None:
        """Lists, watches and reconnects until cancelled."""
        holding = asyncio.create_task(self._hold_while_away())
        backoff_s = self._interval_s
        is_failing = False
        try:
            while True:
                client = self._target.client()
                try:
                    revision = await self._list(client)
                    watch = await client.watch_prefix(self._prefix, start_revision=revision + 1)
                    self.is_synced = True
                    is_failing = False
                    backoff_s = self._interval_s
                    log.info("registry_watching", registry=self._target.describe())
                    await _first_failure(self._consume(watch), self._probe(client))
                except (aetcd.ClientError, TimeoutError) as error:
                    if not is_failing:  # NOTE: once per outage, not once per retry
                        is_failing = True
                        log.warning(
                            "registry_unreachable",
                            registry=self._target.describe(),
                            error=type(error).__name__,
                            detail=str(error),
                            num_instances_held=len(self.instance_ids),
                        )
                except Exception:
                    # NOTE: whatever went wrong, the gateway must not stop following etcd.
                    log.exception("registry_watch_failed", registry=self._target.describe())
                finally:
                    self.is_synced = False
                    with contextlib.suppress(Exception):
                        await client.close()
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
        finally:
            holding.cancel()

    async def _list(self, client: aetcd.Client) -> int:
        """Registers every listed instance, removes known ones that are gone; returns the
        revision the listing is at."""
        listing = await client.get_prefix(self._prefix)
        seen = {self._put(kv.key, kv.value) for kv in listing}
        for instance_id in self.instance_ids - seen:
            self._remove(instance_id)
        return int(listing.header.revision)

    async def _consume(self, watch: Any) -> None:
        async for event in watch:
            if event.kind == aetcd.EventKind.PUT:
                self._put(event.kv.key, event.kv.value)
            else:
                self._remove(event.kv.key.decode(errors="replace").rsplit("/", 1)[-1])
        raise aetcd.ConnectionFailedError("the watch stream ended")

    async def _probe(self, client: aetcd.Client) -> None:
        # NOTE: bounded well below the RPC timeout, so a partition (no reset, just silence)
        # is noticed before the registry's TTL runs out on the instances it holds.
        while True:
            await asyncio.sleep(self._interval_s)
            async with asyncio.timeout(max(self._interval_s, PROBE_TIMEOUT_S)):
                await client.status()

    async def _hold_while_away(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s / 2)
            if not self.is_synced:
                self._registry.touch(self.instance_ids)

    def _put(self, key: bytes, value: bytes) -> str | None:
        """Registers (or heartbeats) the instance of one key; returns its id, None if the
        value is refused (logged)."""
        role, _, instance_id = key[len(self._prefix) :].decode(errors="replace").partition("/")
        try:
            info, load = convert.registration_from_bytes(value)
            if info.role.value != role or info.instance_id != instance_id:
                log.warning(
                    "registry_key_mismatch",
                    key=key.decode(errors="replace"),
                    instance_id=info.instance_id,
                )
                return None
            entry = self._registry.get(instance_id)
            if entry is not None and entry.info == info and instance_id in self.instance_ids:
                self._registry.heartbeat(instance_id, load)
            else:
                self._registry.register(info, load)
        except PdserveError as error:
            log.warning(
                "registry_entry_refused",
                key=key.decode(errors="replace"),
                reason=error.reason.name,
                detail=error.message,
            )
            return None
        self.instance_ids.add(instance_id)
        return instance_id

    def _remove(self, instance_id: str) -> None:
        """An instance's key went: a leave if it said it was draining, else a loss."""
        if instance_id not in self.instance_ids:
            return
        self.instance_ids.discard(instance_id)
        entry = self._registry.get(instance_id)
        if entry is None or entry.load.is_draining:
            self._registry.deregister(instance_id)
        else:
            # NOTE: an instance announces its drain before it revokes its lease, so a key that
            # goes without it lapsed (a crash, a partition): streams that depend on the
            # instance must move now, not at the request timeout.
            self._registry.expire(instance_id)


async def _first_failure(*coros: Any) -> None:
    """Runs `coros` until the first one ends; cancels the rest and re-raises its error."""
    tasks = [asyncio.create_task(coro) for coro in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        task.result()
