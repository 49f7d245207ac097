"""The shared etcd registry with a real etcd: instances register under leases
(`EtcdRegistrationClient`) and two gateways' registries follow them (`EtcdWatcher`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from support.etcd_server import EtcdServer, running_etcd
from support.eventually import eventually

from pdserve.common.etcd_registration import EtcdRegistrationClient
from pdserve.common.etcd_registry import EtcdTarget
from pdserve.common.protocol import kv_layout_fingerprint
from pdserve.gateway.fleet.etcd_watcher import EtcdWatcher
from pdserve.gateway.fleet.registry import Registry
from pdserve.v1 import common_pb2

TTL_S = 2.0  # etcd's smallest lease TTL with its default settings
INTERVAL_S = 0.2


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    with running_etcd(tmp_path) as server:
        yield server


def _instance(instance_id: str) -> common_pb2.InstanceInfo:
    layout = ("demo", 2, 2, 8, "KV_DTYPE_FLOAT32", 16)
    return common_pb2.InstanceInfo(
        instance_id=instance_id,
        role=common_pb2.INSTANCE_ROLE_DECODE,
        address="127.0.0.1:9",
        protocol=common_pb2.Protocol(version="1.0"),
        kv_layout=common_pb2.KvLayout(
            model_id="demo",
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
            dtype=common_pb2.KV_DTYPE_FLOAT32,
            block_size=16,
            fingerprint=kv_layout_fingerprint(*layout),
        ),
        model_name="demo",
        max_model_len=64,
    )


class _Load:
    """A load report whose free-block count and draining flag the test changes."""

    def __init__(self) -> None:
        self.num_free_blocks = 1
        self.is_draining = False

    def __call__(self) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(
            num_free_blocks=self.num_free_blocks, num_total_blocks=99, is_draining=self.is_draining
        )


def _lost_ids(registry: Registry) -> list[str]:
    """The ids `registry` announces as lost from now on (its lost-listeners hear them)."""
    lost: list[str] = []
    registry.add_lost_listener(lambda entry: lost.append(entry.instance_id))
    return lost


@contextlib.asynccontextmanager
async def _running(runner: EtcdRegistrationClient | EtcdWatcher) -> AsyncIterator[None]:
    task = asyncio.create_task(runner.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _free_blocks(registry: Registry, instance_id: str) -> int | None:
    entry = registry.get(instance_id)
    return None if entry is None else entry.load.num_free_blocks


async def test_two_gateways_see_registration_load_and_deregistration(etcd: EtcdServer) -> None:
    target = EtcdTarget.parse(etcd.spec)
    load = _Load()
    client = EtcdRegistrationClient(target, _instance("d1"), load, TTL_S, INTERVAL_S)
    gateways = [Registry(ttl_s=3.0), Registry(ttl_s=3.0)]
    lost = [_lost_ids(gateway) for gateway in gateways]
    watchers = [EtcdWatcher(gateway, target, INTERVAL_S) for gateway in gateways]
    async with _running(watchers[0]), _running(watchers[1]):
        task = asyncio.create_task(client.run())
        await eventually(
            lambda: all(_free_blocks(g, "d1") == 1 for g in gateways), 30, "both see d1"
        )
        load.num_free_blocks = 42
        await eventually(lambda: all(_free_blocks(g, "d1") == 42 for g in gateways), 30, "new load")
        load.is_draining = True  # NOTE: as an instance's stop: it drains, then leaves
        await client.stop()
        await asyncio.wait_for(task, 30)
        await eventually(
            lambda: all(g.get("d1") is None for g in gateways), 30, "d1 gone from both"
        )
    assert lost == [[], []], "a leave was taken for a loss"


async def test_an_instance_that_stops_refreshing_leaves_after_its_lease(
    etcd: EtcdServer,
) -> None:
    target = EtcdTarget.parse(etcd.spec)
    client = EtcdRegistrationClient(target, _instance("d2"), _Load(), TTL_S, INTERVAL_S)
    # NOTE: a registry TTL far above the lease's: only etcd's delete can remove d2 in time.
    gateway = Registry(ttl_s=60.0)
    lost = _lost_ids(gateway)
    async with _running(EtcdWatcher(gateway, target, INTERVAL_S)):
        async with _running(client):  # cancelled without stop(): the instance "died"
            await eventually(lambda: gateway.get("d2") is not None, 30, "d2 registered")
        await asyncio.sleep(TTL_S / 2)
        assert gateway.get("d2") is not None, "removed before its lease lapsed"
        await eventually(lambda: gateway.get("d2") is None, TTL_S + 3, "d2 expired")
    # A lapsed lease is a loss: the streams that depend on d2 move at once.
    assert lost == ["d2"]


async def test_the_view_survives_an_etcd_restart_and_refreshes_after(
    etcd: EtcdServer,
) -> None:
    target = EtcdTarget.parse(etcd.spec)
    load = _Load()
    client = EtcdRegistrationClient(target, _instance("d3"), load, TTL_S, INTERVAL_S)
    gateway = Registry(ttl_s=1.0)  # shorter than the outage below
    watcher = EtcdWatcher(gateway, target, INTERVAL_S)
    async with _running(watcher), _running(client):
        await eventually(lambda: _free_blocks(gateway, "d3") == 1, 30, "d3 registered")
        await asyncio.to_thread(etcd.stop)
        await eventually(lambda: not watcher.is_synced, 30, "the watcher noticed")
        load.num_free_blocks = 7
        for _ in range(15):  # 1.5 s without etcd, longer than the registry's TTL
            await asyncio.sleep(0.1)
            gateway.drop_expired()
            assert gateway.alive(), "the last view was dropped while etcd was away"
        await asyncio.to_thread(etcd.start)
        await eventually(lambda: _free_blocks(gateway, "d3") == 7, 30, "load after restart")
        assert client.num_registrations == 1, "the lease should have survived the restart"
        # NOTE: the listing (which brings the new load) comes before the watch is set up.
        await eventually(lambda: watcher.is_synced, 30, "watching again")


async def test_a_frozen_etcd_is_noticed_and_the_view_held(etcd: EtcdServer) -> None:
    target = EtcdTarget.parse(etcd.spec)
    # NOTE: an etcd lease longer than the freeze: etcd resumes its lease clocks on SIGCONT and
    # may expire a short lease before the client's next refresh, which is no fault of the view.
    client = EtcdRegistrationClient(target, _instance("d4"), _Load(), 10.0, INTERVAL_S)
    gateway = Registry(ttl_s=2.0)
    watcher = EtcdWatcher(gateway, target, INTERVAL_S)
    async with _running(watcher), _running(client):
        await eventually(lambda: gateway.get("d4") is not None, 30, "d4 registered")
        etcd.freeze()
        try:
            # NOTE: a hung etcd closes nothing; only the watcher's probe can tell.
            await eventually(lambda: not watcher.is_synced, 30, "the watcher noticed")
            for _ in range(25):  # 2.5 s, longer than the registry's TTL
                await asyncio.sleep(0.1)
                gateway.drop_expired()
                assert gateway.alive(), "the last view was dropped while etcd hung"
        finally:
            etcd.freeze(False)
        await eventually(lambda: watcher.is_synced, 30, "the watcher back on etcd")
        assert gateway.get("d4") is not None
