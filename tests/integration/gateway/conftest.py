"""Fixtures of the gateway tests: a gateway on port 0 with fake instances."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from support.gateway_cluster import Cluster
from support.threaded_gateway import ThreadedCluster


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    """An empty cluster: the test starts the gateway and adds instances."""
    running = Cluster()
    try:
        yield running
    finally:
        await running.close()


@pytest.fixture
async def pd(cluster: Cluster) -> Cluster:
    """A started gateway with one prefill and one decode."""
    await cluster.start_gateway()
    await cluster.add_prefill()
    await cluster.add_decode()
    return cluster


@pytest.fixture(scope="module")
def threaded_gateway() -> Iterator[ThreadedCluster]:
    """A gateway with one prefill and decode on a thread of its own, for a whole module of
    synchronous tests (a small default chat length keeps completions short)."""
    running = ThreadedCluster(default_chat_max_tokens=8).start()
    try:
        yield running
    finally:
        running.stop()
