"""The fault matrix on real processes: one fault, one target, one phase per case
(`support.fault_matrix` lists the cells and renders the table).

Every cell runs on one cluster the cases share (a gateway, two prefills, two decodes on the
dense demo model, started as `pdserve up` starts them; the prefills compute 16 tokens a pass
so a long prompt is in flight long enough to be hit). A case:

1. finds every instance registered with the gateway and every pool whole;
2. starts four streams of its phase (greedy and seeded) and waits until one is in it (a
   prompt leased and computing; a stream 10 tokens in), then freezes the instances of the
   phase's role so it holds while the victim is picked from the logs (the one holding the most
   of the case's requests in that phase);
3. lands the fault: SIGKILL, then the process is started again at once, as the launcher or
   Kubernetes would; or SIGSTOP, kept until the outcome is in, then SIGCONT;
4. checks each stream's outcome: equal to the undisturbed engine token for token (in every
   built cell an instance of the victim's role is up or coming back, so a typed error, even
   one whose message has no transport string, fails the cell); a cancelled stream is only
   cancelled;
5. waits until every instance is registered again and every block and lease is free.

`make test` runs the cells marked fast; `make chaos` runs them all and prints the table. Each
run appends to ``.pytest_cache/d/fault-matrix/results.jsonl`` (or $PDSERVE_FAULT_MATRIX).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.etcd_server import EtcdServer, running_etcd
from support.eventually import eventually
from support.fault_matrix import BUILT, NETWORK_FAULTS, Cell, record
from support.multi_host import MultiHostCluster, started_across
from support.netns import TestNetwork
from support.process_cluster import (
    ProcessCluster,
    running_cluster,
    sample_at,
    started_event,
    stream_token_ids,
)
from support.real_cluster import Reference
from support.redis_server import RedisServer, running_redis
from support.resumable_client import follow_resumable_completion
from support.resumable_sse import SseEvent, chat_content, left_after, sse_events
from support.small_disk import SmallDisk, small_disk

from pdserve.common.errors import ErrorReason
from pdserve.launcher.child import ChildProcess
from pdserve.launcher.config import ClusterConfig

GREEDY: dict[str, Any] = {"temperature": 0.0}
SEEDED: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95}
REQUEST_TIMEOUT_S = 60.0
# NOTE: not shorter: a prefill computing long prompts in 16-token passes beside a busy machine
# took longer than 3 s to fill a lease (LEASE_EXPIRED, retried until the attempts ran out).
# A lease a frozen or killed instance left ends within it, inside every cell's 20 s wait for
# whole pools.
MATRIX_LEASE_TTL_MS = 10_000
# NOTE: not shorter: beside a 2-core CPU hog a restarted decode's heartbeats lapsed 2 s
# (`instance_expired ttl_s=2.0` twice in one cell, and no lease came for 60 s).
INSTANCE_TTL_S = 4.0
# NOTE: a frozen gateway is thawed after this, longer than an instance's TTL: the instances'
# heartbeats it did not read meanwhile must not count against them (its liveness clock).
GATEWAY_FREEZE_S = 6.0
# NOTE: the most the instances of a role all killed stay down before they start again, if no
# stream waits for them first (`Fault.land_held`).
HELD_RESTART_S = 20.0
NUM_STREAMS = 4
# NOTE: long enough that a stream 10 tokens in is still running when a busy machine gets round
# to freezing the decodes, short enough that four fit on one 200-block decode (45 blocks each).
DECODING_MAX_TOKENS = 700
PREFILL_MAX_TOKENS = 16
# NOTE: a background or left stream runs with nobody reading: long enough to be running when
# the case has found it on a decode.
UNATTACHED_MAX_TOKENS = 1000
# NOTE: a long prompt's lease is ~80 blocks (~96 once 300 tokens are generated): a 200-block
# decode runs two of them, so of eight long requests four wait in the gateway's admission queue.
NUM_QUEUED_STREAMS = 8
QUEUED_MAX_TOKENS = 300
DECODE_BLOCKS = 200
# NOTE: a frozen rank is taken as lost after 5 s (30 by default), in keeping with the cells'
# other short timeouts; a loaded step waits on a rank for milliseconds.
TP2 = "--tensor-parallel-size 2 --num-threads 1 --tensor-parallel-step-timeout-s 5"
SERVER_FAULTS = frozenset({"store_gone", "registry_gone"})
# NOTE: with etcd, a killed gateway's running resumable requests are adopted this long after
# (by the gateway started again in its place, here).
HOLDER_TTL_S = 2.0
ROLES = ("prefill", "decode")
# NOTE: a network fault lasts at least this, longer than an instance's TTL (the gateway drops
# what it cannot hear), even where the outcome is in at once (streams the client cancelled); a
# gateway cut off from every instance is joined again after it (no outcome comes in before).
NETWORK_FAULT_S = 6.0
# NOTE: a slowed link: a long prompt's KV (~2.4 MB of float32) takes about 2 s through it.
SLOW_RATE = "10mbit"
SLOW_DELAY_MS = 50
NET_HOSTS = ("gateway", "prefill-0", "prefill-1", "decode-0", "decode-1")
# NOTE: the network cells of the KV store and the registry: redis and etcd on hosts of their own.
SERVER_HOSTS = ("store", "registry")
LONG_PROMPT = "pack my box with five dozen liquor jugs " * 30  # ~1,200 byte tokens
# NOTE: the disk_full cells' file store: a 64 MiB tmpfs, the store bounded well inside it (each
# process's bound is over the whole directory), so only the cells' filler ever fills it.
DISK_BYTES = 64 << 20
DISK_STORE_MAX_BYTES = 16 << 20
# NOTE: decodes of the disk_full cells: four background or resumed requests of 1,000 tokens
# (~65 blocks each) outgrow two 128-block decodes, which preempt and offload to the full disk.
DISK_DECODE_BLOCKS = 128
# NOTE: a prompt the prefills have not seen (a fresh number, then this: ~15 blocks), sent
# while the disk is still full once the outcome is in, and one after it has room again: every
# disk_full cell writes to the full disk, and the store takes writes again after it.
DISK_PROBE_PROMPT = "the quick brown fox jumps over the lazy dog "
DISK_PROBE_MAX_TOKENS = 8

# NOTE: what a transport says when a connection breaks; a client must never read it.
TRANSPORT_WORDS = (
    "recvmsg",
    "ConnectionFailedError",
    "Stream removed",
    "Socket closed",
    "failed to connect",
    "Connection reset",
    "GOAWAY",
    "ipv4:",
)
TYPED_CODES = frozenset(reason.value.lower() for reason in ErrorReason)

UP_EVENTS = frozenset({"instance_registered", "instance_reachable"})
DOWN_EVENTS = frozenset(
    {"instance_unreachable", "instance_expired", "instance_lost", "instance_deregistered"}
)


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> Reference:
    return Reference(demo_model_dir, deterministic=True)


def matrix_settings(lease_ttl_ms: int, instance_args: str = "") -> dict[str, str]:
    """The `ClusterConfig` fields of every cell's cluster: two decodes of `DECODE_BLOCKS`
    blocks, prefills that compute 16 tokens a pass, short timeouts, batch-invariant numerics
    (`instance_args`: more flags of both, e.g. tensor parallelism)."""
    # NOTE: a frozen instance stops heartbeating: the gateway drops it after 2 s and moves the
    # streams that depend on it; a prefill gives a frozen decode 1.5 s to grant a lease. A
    # stream moved off a lost decode is recomputed by a prefill, whose attention sums in
    # another order than the decode steps it replaces: only `--deterministic` promises the same
    # tokens after (a seeded stream moved after its first token once took another at its 60th).
    return {
        "prefill_args": f"--num-blocks 512 --max-num-batched-tokens 16 --allocate-timeout-ms "
        f"1500 --deterministic {instance_args}",
        "decode_args": f"--num-blocks {DECODE_BLOCKS} --lease-ttl-ms {lease_ttl_ms} "
        f"--deterministic {instance_args}",
        "gateway_args": f"--request-timeout {REQUEST_TIMEOUT_S:g} --heartbeat-interval-s 0.5 "
        f"--instance-ttl-s {INSTANCE_TTL_S:g} --resume-holder-ttl-s {HOLDER_TTL_S:g}",
    }


@contextlib.contextmanager
def thawed_at_end(cluster: ProcessCluster) -> Iterator[ProcessCluster]:
    """`cluster`, every frozen process of it thawed at the end."""
    try:
        yield cluster
    finally:
        for child in cluster.instances:
            child.signal(signal.SIGCONT)


@contextlib.contextmanager
def matrix_cluster_of(
    model_dir: Path,
    log_dir: Path,
    *,
    prefills: int,
    lease_ttl_ms: int,
    instance_args: str = "",
    **settings: Any,
) -> Iterator[ProcessCluster]:
    """The cells' cluster: `prefills` prefills and two decodes (`matrix_settings`; `settings`:
    more `ClusterConfig` fields)."""
    with (
        running_cluster(
            model_dir,
            log_dir,
            prefills=prefills,
            decodes=2,
            **matrix_settings(lease_ttl_ms, instance_args),
            **settings,
        ) as cluster,
        thawed_at_end(cluster),
    ):
        yield cluster


@pytest.fixture(scope="module")
def matrix_cluster(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessCluster]:
    """Two prefills and two decodes, each a single process."""
    log_dir = tmp_path_factory.mktemp("fault-matrix")
    with matrix_cluster_of(
        demo_model_dir, log_dir, prefills=2, lease_ttl_ms=MATRIX_LEASE_TTL_MS
    ) as cluster:
        yield cluster


def net_cluster_config(
    model_dir: Path, network: TestNetwork, log_dir: Path, instance_args: str = "", **servers: str
) -> ClusterConfig:
    """The `ClusterConfig` of a cluster whose gateway, two prefills and two decodes each run on
    a test host of `network`, float32, KV over TCP (shared memory would go round a cut link);
    `servers`: its ``registry`` and ``kv_store``, if any."""
    settings = matrix_settings(3000, instance_args)
    settings["prefill_args"] = f"--dtype float32 {settings['prefill_args']}"
    settings["decode_args"] = f"--dtype float32 --kv-transports tcp {settings['decode_args']}"
    return ClusterConfig(
        model=str(model_dir),
        prefills=2,
        decodes=2,
        host=network.hosts["gateway"].address,
        port=0,
        grpc_port=0,
        internal_port=0,
        log_dir=str(log_dir),
        startup_timeout_s=120,
        **servers,
        **settings,
    )


@pytest.fixture(scope="module")
def net_matrix_cluster(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessCluster]:
    """The cluster of the network cells: the gateway, two prefills and two decodes each on a
    test host of its own (`support.netns`), reaching each other only over the network (KV over
    TCP: shared memory would go round a cut link)."""
    log_dir = tmp_path_factory.mktemp("fault-matrix-net")
    with TestNetwork(NET_HOSTS) as network:
        config = net_cluster_config(demo_model_dir, network, log_dir)
        with started_across(config, network) as cluster, thawed_at_end(cluster):
            yield cluster


@pytest.fixture(scope="module")
def split_matrix_cluster(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessCluster]:
    """The cluster of the rank cells: every prefill and decode split over two ranks (one
    prefill, two decodes: the lost prefill's requests wait for it to come back)."""
    # NOTE: a split prefill on a busy 2-core machine takes seconds for a long prompt in
    # 16-token passes: the leases wait for it.
    log_dir = tmp_path_factory.mktemp("fault-matrix-split")
    with matrix_cluster_of(
        demo_model_dir, log_dir, prefills=1, lease_ttl_ms=15000, instance_args=TP2
    ) as cluster:
        yield cluster


@dataclass
class Servers:
    """The KV store and the registry a cluster of the server cells runs on."""

    store: RedisServer
    registry: EtcdServer


@pytest.fixture(scope="module")
def servers_matrix_cluster(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessCluster]:
    """The cluster of the store and registry cells: every instance on a redis KV store, every
    instance and the gateway on an etcd registry (both are taken down by the cells)."""
    work_dir = tmp_path_factory.mktemp("fault-matrix-servers")
    with (
        running_redis(work_dir) as store,
        running_etcd(work_dir) as registry,
        matrix_cluster_of(
            demo_model_dir,
            work_dir / "logs",
            prefills=2,
            lease_ttl_ms=MATRIX_LEASE_TTL_MS,
            instance_args="--registry-ttl-s 2 --heartbeat-interval-s 0.5",
            registry=registry.spec,
            kv_store=store.spec,
        ) as cluster,
    ):
        cluster.servers = Servers(store, registry)  # type: ignore[attr-defined]
        yield cluster


@pytest.fixture(scope="module")
def net_servers_matrix_cluster(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessCluster]:
    """The cluster of the store's and registry's network cells: as `net_matrix_cluster`, every
    instance keeping KV in redis and registering in etcd (the gateway too), redis on a test
    host ``store`` and etcd on a test host ``registry`` of their own."""
    work_dir = tmp_path_factory.mktemp("fault-matrix-net-servers")
    with (
        TestNetwork((*NET_HOSTS, *SERVER_HOSTS)) as network,
        running_redis(work_dir, on=network.hosts["store"]) as store,
        running_etcd(work_dir, on=network.hosts["registry"]) as registry,
    ):
        config = net_cluster_config(
            demo_model_dir,
            network,
            work_dir / "logs",
            "--registry-ttl-s 2 --heartbeat-interval-s 0.5",
            registry=registry.spec,
            kv_store=store.spec,
        )
        with started_across(config, network) as cluster, thawed_at_end(cluster):
            cluster.servers = Servers(store, registry)  # type: ignore[attr-defined]
            yield cluster


@dataclass
class DiskStore:
    """The small disk the file store of a cluster of the disk_full cells is on, the reference
    its probe requests are checked against, and the store errors counted by the last cell."""

    disk: SmallDisk
    reference: Reference
    errors_seen: float = 0.0
    offloads_skipped_seen: float = 0.0


@pytest.fixture(scope="module")
def disk_matrix_cluster(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, reference: Reference
) -> Iterator[ProcessCluster]:
    """The cluster of the disk_full cells: two prefills and two decodes keeping KV in one file
    store on a small disk (a tmpfs the cells fill), decodes of `DISK_DECODE_BLOCKS` blocks."""
    work_dir = tmp_path_factory.mktemp("fault-matrix-disk")
    with small_disk(work_dir / "disk", DISK_BYTES) as disk:
        settings = matrix_settings(3000)
        settings["decode_args"] = settings["decode_args"].replace(
            f"--num-blocks {DECODE_BLOCKS}", f"--num-blocks {DISK_DECODE_BLOCKS}"
        )
        with (
            running_cluster(
                demo_model_dir,
                work_dir / "logs",
                prefills=2,
                decodes=2,
                kv_store=f"file:{disk.root / 'kv'}?max_bytes={DISK_STORE_MAX_BYTES}",
                **settings,
            ) as cluster,
            thawed_at_end(cluster),
        ):
            cluster.disk_store = DiskStore(disk, reference)  # type: ignore[attr-defined]
            yield cluster


@pytest.fixture(scope="module")
def results_path(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("PDSERVE_FAULT_MATRIX")
    if configured:
        return Path(configured)
    cache = getattr(pytestconfig, "cache", None)
    if cache is None:  # NOTE: -p no:cacheprovider: the run's results stay in its temp dir
        return tmp_path_factory.mktemp("fault-matrix") / "results.jsonl"
    return cache.mkdir("fault-matrix") / "results.jsonl"


# ---- reading the processes' logs -------------------------------------------------------------


def log_mark(cluster: ProcessCluster) -> dict[str, int]:
    return {child.name: len(child.events) for child in cluster.children}


def since(mark: dict[str, int], child: ChildProcess, event: str) -> list[dict[str, Any]]:
    records = list(child.events)[mark.get(child.name, 0) :]
    return [r for r in records if r.get("event") == event]


def instance_id(child: ChildProcess) -> str:
    return str(started_event(child)["instance_id"])


def gateway_sees_every_instance(cluster: ProcessCluster) -> bool:
    """Whether the gateway's last word on each instance is that it is up."""
    assert cluster.gateway is not None
    state: dict[str, bool] = {}
    for record_ in list(cluster.gateway.events):
        event = record_.get("event")
        if event in UP_EVENTS or event in DOWN_EVENTS:
            state[str(record_.get("instance_id"))] = event in UP_EVENTS
    try:
        ids = [instance_id(child) for child in cluster.instances]
    except AssertionError:
        return False  # a restarted process has not served yet
    return all(state.get(i, False) for i in ids) and all(
        c.returncode is None for c in cluster.instances
    )


# ---- holding a phase while the victim is picked ------------------------------------------------


@contextlib.asynccontextmanager
async def frozen(children: list[ChildProcess], fault: Fault) -> AsyncIterator[None]:
    """SIGSTOPs `children` while the block runs (so the phase they are in holds), then
    SIGCONTs those the fault did not take (a frozen victim stays frozen)."""
    held = list(children)
    for child in held:
        child.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for child in held:
            if child not in fault.stopped and child.returncode is None:
                child.signal(signal.SIGCONT)


async def settled(count: Callable[[], dict[str, int]]) -> dict[str, int]:
    """`count()` once it held for 0.3 s (the logs are read a moment after they are written),
    or after 5 s."""
    deadline = time.monotonic() + 5.0
    last = count()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        now = count()
        if now == last and any(now.values()):
            return now
        last = now
    return last


@dataclass
class Fault:
    """A landed fault: which processes were killed (and started again) or frozen."""

    killed: list[ChildProcess] = field(default_factory=list)
    stopped: list[ChildProcess] = field(default_factory=list)
    frozen_ranks: list[tuple[ChildProcess, int, int]] = field(default_factory=list)
    watchers: list[asyncio.Task[None]] = field(default_factory=list)
    is_undoing: bool = False
    gone: list[RedisServer | EtcdServer] = field(default_factory=list)
    comeback: asyncio.Task[None] | None = None
    links: list[str] = field(default_factory=list)  # test hosts cut off or slowed
    slowed_by: str = ""  # what slows a slowed link (netem, or tbf without it)
    links_until: float = 0.0  # the links are restored no earlier (monotonic)
    full_disk: DiskStore | None = None  # the file store's disk, filled
    filled_at: dict[str, int] = field(default_factory=dict)  # the logs' mark when it filled
    felt: str = ""  # what the fault did, for the cell's detail (disk_full)

    def land(
        self,
        cluster: ProcessCluster,
        kind: str,
        victim: ChildProcess,
        *,
        rank: bool = False,
        target: str = "",
    ) -> None:
        """Lands fault `kind` on `victim` (on the store's or registry's test host where
        `target` names it: the victim then only marks the phase held)."""
        if kind in NETWORK_FAULTS and target in SERVER_HOSTS:
            # NOTE: redis's or etcd's host: cut off from every host, or its link slowed both
            # ways; restored once the outcome is in (no earlier than `NETWORK_FAULT_S`). etcd's
            # host cut off is joined again after that (as etcd comes back in registry_gone):
            # a background response is read from it, so its outcome cannot come in before.
            assert isinstance(cluster, MultiHostCluster)
            self.links.append(target)
            self.links_until = time.monotonic() + NETWORK_FAULT_S
            if kind == "slow_link":
                self.slowed_by = cluster.network.slow(target, SLOW_RATE, SLOW_DELAY_MS)
            else:
                cluster.network.partition(target)
                if target == "registry":
                    self.comeback = asyncio.create_task(
                        self.restore_after(cluster.network, NETWORK_FAULT_S)
                    )
        elif kind in NETWORK_FAULTS:
            # NOTE: the victim's host: a prefill or decode is cut off from every host (its
            # link is down), a gateway from the instances only (clients still reach it); a
            # slowed link is slow both ways. All are restored once the outcome is in; a
            # gateway cut off, after a while (no outcome comes in before).
            assert isinstance(cluster, MultiHostCluster) and not rank
            network = cluster.network
            self.links.append(victim.name)
            self.links_until = time.monotonic() + NETWORK_FAULT_S
            if kind == "slow_link":
                self.slowed_by = network.slow(victim.name, SLOW_RATE, SLOW_DELAY_MS)
            elif victim is cluster.gateway:
                network.cut(victim.name, [child.name for child in cluster.instances])
                self.comeback = asyncio.create_task(self.restore_after(network, NETWORK_FAULT_S))
            else:
                network.partition(victim.name)
        elif kind == "disk_full":
            # NOTE: the victim only marks the phase held; the file store's disk fills: every
            # write to it after this gets ENOSPC, until the outcome is in.
            self.full_disk = cluster.disk_store  # type: ignore[attr-defined]
            assert self.full_disk is not None and not self.full_disk.disk.is_full
            self.filled_at = log_mark(cluster)
            self.full_disk.disk.fill()
        elif kind in SERVER_FAULTS:
            # NOTE: the victim only marks the phase held; the store or registry goes away.
            servers: Servers = cluster.servers  # type: ignore[attr-defined]
            server = servers.store if kind == "store_gone" else servers.registry
            assert cluster.gateway is not None
            mark = len(cluster.gateway.events)
            server.stop()
            if kind == "registry_gone":
                # NOTE: etcd comes back once the gateway noticed it gone (it holds its view of
                # the instances meanwhile): the store of resumable requests is etcd too, and
                # a kept or resumed request is read from it.
                self.comeback = asyncio.create_task(self.back_when_noticed(cluster, server, mark))
            else:
                self.gone.append(server)
        elif rank and kind == "sigstop":
            # NOTE: rank 1 of a split instance freezes; rank 0 still runs and heartbeats, until
            # a step's collective waits longer than the step timeout: then it takes the rank as
            # lost and goes down, and is started again (as the launcher would). An instance
            # with no step to run meanwhile (a prefill while its streams decode) never notices.
            (rank_one,) = list(since({}, victim, "tensor_parallel_ready"))[-1]["pids"]
            os.kill(rank_one, signal.SIGSTOP)
            self.frozen_ranks.append((victim, rank_one, len(victim.events)))
            self.watchers.append(asyncio.create_task(self.restart_when_down(cluster, victim)))
        elif rank:
            # NOTE: rank 1 of a split instance: the instance goes down as a whole (rank 0
            # stops and exits), and is started again.
            assert kind == "sigkill"
            # NOTE: its exit is waited for on a task: rank 0 may be in a collective, and gives up
            # on it only after the step timeout (5 s here), while the case holds the instances
            # of its phase frozen until the fault has landed. A split instance frozen that long
            # (its main process: its ranks run on) would lose a rank of its own.
            (rank_one,) = list(since({}, victim, "tensor_parallel_ready"))[-1]["pids"]
            os.kill(rank_one, signal.SIGKILL)
            victim.signal(signal.SIGCONT)  # NOTE: rank 0 may be frozen while the case picks
            watcher = self.restart_when_down(cluster, victim, must_exit=True)
            self.watchers.append(asyncio.create_task(watcher))
        elif kind == "sigkill":
            victim.signal(signal.SIGKILL)
            assert victim.wait(10) == -signal.SIGKILL
            self.killed.append(cluster.restart(victim))
        elif victim is cluster.gateway:
            # NOTE: no outcome comes in while the gateway is frozen: it is thawed after a while.
            assert kind == "sigstop"
            victim.signal(signal.SIGSTOP)
            self.comeback = asyncio.create_task(self.thaw_after(victim, GATEWAY_FREEZE_S))
        else:
            assert kind == "sigstop"
            victim.signal(signal.SIGSTOP)
            self.stopped.append(victim)

    def land_cell(self, cluster: ProcessCluster, cell: Cell, victim: ChildProcess) -> None:
        """Lands `cell`'s fault on `victim` (`land` with the cell's kind, rank and target)."""
        self.land(cluster, cell.fault, victim, rank=cell.is_rank, target=cell.target)

    def land_held(self, cluster: ProcessCluster, victims: list[ChildProcess]) -> None:
        """SIGKILLs `victims` (every instance of a role) and starts them again only once the
        gateway holds a rescheduled stream waiting for a pair (its ``waiting_for_peer``), or
        after `HELD_RESTART_S`: started again at once, on a fast machine they registered before
        the gateway had found the old ones gone, and no stream had to wait."""
        mark = log_mark(cluster)
        for victim in victims:
            victim.signal(signal.SIGKILL)
            assert victim.wait(10) == -signal.SIGKILL
        self.watchers.append(asyncio.create_task(self.restart_once_waited(cluster, victims, mark)))

    async def restart_once_waited(
        self, cluster: ProcessCluster, victims: list[ChildProcess], mark: dict[str, int]
    ) -> None:
        gateway = gateway_of(cluster)
        deadline = time.monotonic() + HELD_RESTART_S
        while not since(mark, gateway, "waiting_for_peer") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for victim in victims:
            self.killed.append(cluster.restart(victim))

    async def restart_when_down(
        self, cluster: ProcessCluster, victim: ChildProcess, must_exit: bool = False
    ) -> None:
        """Starts `victim` again once it exits (as the launcher would), until the fault is
        undone with the instance still up (unless it `must_exit`: then within 30 s)."""
        deadline = time.monotonic() + 30.0
        while victim.returncode is None:
            if self.is_undoing and not must_exit:
                return
            assert time.monotonic() < deadline, f"{victim.name} did not exit"
            await asyncio.sleep(0.1)
        assert victim.returncode == 1, victim.describe_exit()
        self.killed.append(cluster.restart(victim))

    async def restore_after(self, network: TestNetwork, seconds: float) -> None:
        await asyncio.sleep(seconds)
        for name in self.links:
            network.restore(name)

    async def thaw_after(self, victim: ChildProcess, seconds: float) -> None:
        await asyncio.sleep(seconds)
        victim.signal(signal.SIGCONT)

    async def free_disk(self, cluster: ProcessCluster, store: DiskStore) -> None:
        """Once the outcome is in: counts the store writes that failed on the full disk, sends
        a probe request (it writes to the disk, still full, and completes equal to the
        undisturbed engine), frees the disk, and waits for a write to land again."""
        try:
            by_cell = await store_errors(cluster) - store.errors_seen
            offloads_skipped = await instances_counter(cluster, "decode", "kv_offloads_skipped")
            by_offloads = offloads_skipped - store.offloads_skipped_seen
            store.offloads_skipped_seen = offloads_skipped
            probe = f"{time.monotonic_ns()} {DISK_PROBE_PROMPT * 5}"
            expected = await asyncio.to_thread(
                store.reference.completion, probe, max_tokens=DISK_PROBE_MAX_TOKENS, **GREEDY
            )
            async with cluster.openai(timeout_s=REQUEST_TIMEOUT_S) as client:
                got = await stream_token_ids(
                    client, cluster.model_name, probe, max_tokens=DISK_PROBE_MAX_TOKENS, **GREEDY
                )
                assert got == expected, "the probe differs from its undisturbed run"
                before_probe = store.errors_seen + by_cell
                await eventually(
                    lambda: store_errors_above(cluster, before_probe),
                    REQUEST_TIMEOUT_S,
                    "the probe request's write failing on the full disk",
                )
                by_probe = await store_errors(cluster) - before_probe
                store.disk.free()
                stored_bytes = "kv_store_stored_bytes"
                stored = await instances_counter(cluster, "prefill", stored_bytes)
                again = f"{time.monotonic_ns()} {DISK_PROBE_PROMPT * 5}"
                await stream_token_ids(
                    client, cluster.model_name, again, max_tokens=DISK_PROBE_MAX_TOKENS, **GREEDY
                )
            await eventually(
                lambda: instances_counter_above(cluster, "prefill", stored_bytes, stored),
                REQUEST_TIMEOUT_S,
                "a write to the store landing once the disk had room",
            )
            store.errors_seen = await store_errors(cluster)
            warned = sum(len(since(self.filled_at, c, "kv_store_full")) for c in cluster.instances)
            self.felt = (
                f"; store writes failed on the full disk: {by_cell:.0f} by the cell's requests "
                f"({by_offloads:.0f} offloads of preempted ones), {by_probe:.0f} by a probe "
                f"request after; kv_store_full warnings {warned}"
            )
        finally:
            store.disk.free()

    async def back_when_noticed(
        self, cluster: ProcessCluster, server: RedisServer | EtcdServer, mark: int
    ) -> None:
        assert cluster.gateway is not None
        gateway = cluster.gateway
        await eventually(
            lambda: since({gateway.name: mark}, gateway, "registry_unreachable"),
            REQUEST_TIMEOUT_S,
            "the gateway noticed the registry gone",
        )
        await asyncio.to_thread(server.start)

    async def undo(self, cluster: ProcessCluster) -> None:
        if self.comeback is not None:
            await self.comeback
        if self.full_disk is not None:
            await self.free_disk(cluster, self.full_disk)
        if self.links:
            assert isinstance(cluster, MultiHostCluster)
            await asyncio.sleep(max(0.0, self.links_until - time.monotonic()))
            for name in self.links:
                cluster.network.restore(name)
        for server in self.gone:
            await asyncio.to_thread(server.start)
        for child in self.stopped:
            child.signal(signal.SIGCONT)
        for instance, pid, mark in self.frozen_ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            if since({instance.name: mark}, instance, "tensor_parallel_ranks_abandoned"):
                # NOTE: it is going down: its watcher starts it again.
                await asyncio.to_thread(instance.wait, REQUEST_TIMEOUT_S)
        self.is_undoing = True
        for watcher in self.watchers:
            await watcher
        for child in self.killed:
            is_gateway = child in cluster.gateways
            started = "gateway_started" if is_gateway else "registered"
            await asyncio.to_thread(child.wait_for_event, started, 60)


def network_detail(cluster: ProcessCluster, mark: dict[str, int], fault: Fault) -> str:
    """What a network cell adds to its result: how the link was slowed, and how often the
    gateway dropped an instance it did not hear from in time (its TTL) or took one out of
    routing after a failed call, meanwhile (e.g. heartbeats queued behind KV)."""
    if not fault.links:
        return ""
    assert cluster.gateway is not None
    expired = len(since(mark, cluster.gateway, "instance_expired"))
    unreachable = len(since(mark, cluster.gateway, "instance_unreachable"))
    slowed = f"; link {fault.slowed_by}" if fault.slowed_by else ""
    return f"{slowed}; instances expired {expired}, unreachable {unreachable}"


async def instances_counter(cluster: ProcessCluster, role: str, name: str) -> float:
    """A ``pdserve_<role>_<name>`` counter summed over the role's instances."""
    children = cluster.prefills if role == "prefill" else cluster.decodes
    return sum([await cluster.instance_counter(c, f"pdserve_{role}_{name}") for c in children])


async def instances_counter_above(
    cluster: ProcessCluster, role: str, name: str, value: float
) -> bool:
    return await instances_counter(cluster, role, name) > value


async def store_errors(cluster: ProcessCluster) -> float:
    """KV store operations that failed, over every prefill and decode (``kv_store_errors``)."""
    return sum([await instances_counter(cluster, r, "kv_store_errors") for r in ROLES])


async def store_errors_above(cluster: ProcessCluster, value: float) -> bool:
    return await store_errors(cluster) > value


async def restarted_gateway_detail(cluster: ProcessCluster, fault: Fault) -> str:
    """What a killed gateway's cell adds to its result: how the requests it held went on
    through the gateway started in its place (resumed by their clients, which takes them over
    from the record, or adopted with no client asking)."""
    if not any(child in cluster.gateways for child in fault.killed):
        return ""
    resumes = {
        how: await cluster.counter("pdserve_gateway_resumes", how=how)
        for how in ("takeover", "adopted")
    }
    return (
        f"; through the gateway started again: {resumes['takeover']:.0f} taken over by their "
        f"clients, {resumes['adopted']:.0f} adopted"
    )


def running_decodes(cluster: ProcessCluster, mark: dict[str, int]) -> Callable[[], dict[str, int]]:
    """Per decode: the case's streams it committed a lease for that have not finished."""
    assert cluster.gateway is not None
    gateway = cluster.gateway

    def count() -> dict[str, int]:
        finished = {e["request_id"] for e in since(mark, gateway, "request_finished")}
        return {
            d.name: len({e["request_id"] for e in since(mark, d, "lease_committed")} - finished)
            for d in cluster.decodes
        }

    return count


def prefilling(cluster: ProcessCluster, mark: dict[str, int]) -> Callable[[], dict[str, int]]:
    """Per prefill: the case's prompts it leased decode blocks for and has not finished."""

    def count() -> dict[str, int]:
        return {
            p.name: len(
                {e["request_id"] for e in since(mark, p, "lease_granted")}
                - {e["request_id"] for e in since(mark, p, "first_token")}
            )
            for p in cluster.prefills
        }

    return count


def leased(
    cluster: ProcessCluster, mark: dict[str, int], role: str
) -> Callable[[], dict[str, int]]:
    """Per instance of `role`: the case's requests it granted (decode) or asked for (prefill)
    a lease for that have not finished there."""
    assert cluster.gateway is not None
    gateway = cluster.gateway
    children = cluster.decodes if role == "decode" else cluster.prefills
    ended = "request_finished" if role == "decode" else "first_token"

    def count() -> dict[str, int]:
        done_there = {
            e["request_id"] for child in (gateway, *children) for e in since(mark, child, ended)
        }
        return {
            c.name: len({e["request_id"] for e in since(mark, c, "lease_granted")} - done_there)
            for c in children
        }

    return count


async def waited_or_ended(
    waiting: Callable[[], Awaitable[bool]], tasks: list[asyncio.Task[Any]]
) -> bool:
    """Waits until `waiting()` holds (True) or every task ended first (False); fails after
    `REQUEST_TIMEOUT_S` saying how many ended and how."""
    has_waited = False

    async def waited_or_all_ended() -> bool:
        nonlocal has_waited
        has_waited = await waiting()
        return has_waited or all(task.done() for task in tasks)

    try:
        await eventually(waited_or_all_ended, REQUEST_TIMEOUT_S, "a request waiting for room")
    except AssertionError as error:
        ended = [task.result() if not task.exception() else task.exception()
                 for task in tasks if task.done() and not task.cancelled()]  # fmt: skip
        raise AssertionError(
            f"{error}; {len(ended)} of {len(tasks)} requests ended: {outcomes_of(ended)}"
        ) from None
    return has_waited


def outcomes_of(results: list[Any]) -> str:
    """Each request's outcome in a few words: its token count, or its error."""
    return ", ".join(
        f"{type(r).__name__}: {str(r)[:120]}"
        if isinstance(r, BaseException)
        else f"{len(r)} tokens"
        for r in results
    )


def by_name(cluster: ProcessCluster, name: str) -> ChildProcess:
    return next(c for c in cluster.instances if c.name == name)


def gateway_of(cluster: ProcessCluster) -> ChildProcess:
    assert cluster.gateway is not None
    return cluster.gateway


# ---- one cell ----------------------------------------------------------------------------------


@dataclass
class Outcomes:
    completed: int = 0
    typed_errors: list[str] = field(default_factory=list)
    cancelled: int = 0

    def describe(self) -> str:
        parts = [f"{self.completed} completed equal"]
        if self.typed_errors:
            parts.append(f"{len(self.typed_errors)} typed errors ({', '.join(self.typed_errors)})")
        if self.cancelled:
            parts.append(f"{self.cancelled} cancelled")
        return ", ".join(parts)


def assert_no_transport_words(message: str) -> None:
    for words in TRANSPORT_WORDS:
        assert words not in message, f"a transport string reached a client: {message}"


def judge(results: list[Any], expected: list[list[int]], cell: Cell) -> Outcomes:
    outcomes = Outcomes()
    for result, wanted in zip(results, expected, strict=True):
        if isinstance(result, asyncio.CancelledError):
            assert cell.phase == "cancelling", "a stream was cancelled that no client cancelled"
            outcomes.cancelled += 1
        elif isinstance(result, openai.APIError):
            code = str(getattr(result, "code", "") or "")
            assert code in TYPED_CODES, f"an untyped error reached the client: {result!r}"
            assert_no_transport_words(str(result.message))
            outcomes.typed_errors.append(f"{code}: {result.message}")
        elif isinstance(result, BaseException):
            raise AssertionError(f"a stream ended with {result!r}") from result
        else:
            assert result == wanted, "a stream differs from the undisturbed run"
            outcomes.completed += 1
    return outcomes


async def run_cell(cell: Cell, cluster: ProcessCluster, reference: Reference) -> str:
    await eventually(lambda: gateway_sees_every_instance(cluster), 60, "every instance up")
    await cluster.wait_whole(timeout_s=20)
    is_prefill_phase = cell.phase == "prefilling"
    is_long = cell.phase in ("prefilling", "queued")
    max_tokens = {"prefilling": PREFILL_MAX_TOKENS, "queued": QUEUED_MAX_TOKENS}.get(
        cell.phase, DECODING_MAX_TOKENS
    )
    num_streams = NUM_QUEUED_STREAMS if cell.phase == "queued" else NUM_STREAMS

    def requests_of(attempt: int) -> list[tuple[str, dict[str, Any]]]:
        # NOTE: another attempt's prompts differ from their second word: no prefix cache hit.
        again = f" again {attempt}" if attempt else ""
        return [
            (
                f"{cell.cell_id}{again} {i} {LONG_PROMPT if is_long else 'once upon a time'}",
                GREEDY if i % 2 == 0 else {**SEEDED, "seed": 100 + i},
            )
            for i in range(num_streams)
        ]

    requests = requests_of(0)

    # NOTE: the undisturbed run is made once the fault has landed, while the streams go on (in
    # a thread: the engine releases the GIL in its kernels), not before the phase is reached:
    # on a busy machine its Python work slowed this loop's requests enough that eight sent at
    # once arrived one by one and none waited in the admission queue. Streams the client
    # cancels need none unless one ended first.
    def undisturbed() -> list[list[int]]:
        return reference.completions([(p, {**s, "max_tokens": max_tokens}) for p, s in requests])

    expected_task: asyncio.Future[list[list[int]]] | None = None
    mark = log_mark(cluster)
    before_back = await cluster.counter("pdserve_gateway_peer_waits", outcome="came_back")
    is_streaming = asyncio.Event()

    def on_tokens(ids: list[int]) -> None:
        if len(ids) >= 10:
            is_streaming.set()

    fault = Fault()
    # NOTE: a killed gateway's clients resume their streams where it is started again (a
    # client of a plain stream could only send it again); cancelled streams are plain ones.
    is_killed_gateway = (cell.target, cell.fault) == ("gateway", "sigkill")
    is_resumable = is_killed_gateway and cell.phase != "cancelling"
    async with (
        cluster.openai(timeout_s=REQUEST_TIMEOUT_S + 30) as client,
        httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S + 30) as http,
    ):

        def start() -> list[asyncio.Task[Any]]:
            return [
                asyncio.create_task(
                    follow_resumable_completion(
                        http, cluster.rest_url,
                        {"model": cluster.model_name, "prompt": prompt, "max_tokens": max_tokens,
                         **sampling},
                        on_tokens=on_tokens, timeout_s=REQUEST_TIMEOUT_S + 20,
                    )
                    if is_resumable
                    else stream_token_ids(
                        client, cluster.model_name, prompt, max_tokens=max_tokens,
                        on_tokens=on_tokens, timeout_s=REQUEST_TIMEOUT_S + 20, **sampling,
                    )
                )
                for prompt, sampling in requests
            ]  # fmt: skip

        tasks = start()
        try:
            if cell.phase == "queued":
                # NOTE: eight long requests where the decodes' room holds four: the other four
                # wait in the gateway while the first ones run (seconds each): in its admission
                # queue, or, where a decode refused a lease the gateway thought it had room for
                # (its load report not yet in after a restart), told to wait for room.
                gateway = gateway_of(cluster)

                async def waiting() -> bool:
                    if since(mark, gateway, "waiting_for_room"):
                        return True
                    url = f"{cluster.rest_url}/metrics"
                    return bool(await sample_at(url, "pdserve_gateway_queued_requests"))

                # NOTE: on a machine busy enough every request may have ended (or failed)
                # before this process saw one wait: they are awaited and sent again with other
                # prompts, twice at most; the last time's outcomes say what happened.
                for attempt in range(3):
                    if await waited_or_ended(waiting, tasks):
                        break
                    ended = await asyncio.gather(*tasks, return_exceptions=True)
                    assert attempt < 2, f"no request waited for decode room: {outcomes_of(ended)}"
                    mark = log_mark(cluster)
                    requests = requests_of(attempt + 1)
                    tasks = start()
                if cell.role == "gateway":
                    victim = gateway_of(cluster)
                elif cell.role == "decode":
                    # NOTE: the gateway queues as the requests come in, before a prefill asked
                    # a decode for a lease (or its log says so): the victim holds one, picked
                    # with the decodes frozen. Beside a CPU hog every request once ended before
                    # this process counted the leases: they are awaited and sent again, with
                    # other prompts, twice at most.
                    for attempt in range(3):
                        count = leased(cluster, mark, "decode")

                        def leasing_or_done(
                            count: Callable[[], dict[str, int]] = count,
                            running: list[asyncio.Task[Any]] = tasks,
                        ) -> bool:
                            return any(count().values()) or all(task.done() for task in running)

                        await eventually(leasing_or_done, REQUEST_TIMEOUT_S, "a decode leasing")
                        async with frozen(cluster.decodes, fault):
                            held = await settled(count)
                            if any(held.values()) or attempt == 2:
                                victim = by_name(cluster, max(held, key=lambda n: held[n]))
                                assert held[victim.name] > 0, "no decode held a request"
                                fault.land_cell(cluster, cell, victim)
                                break
                        await asyncio.gather(*tasks, return_exceptions=True)
                        mark = log_mark(cluster)
                        requests = requests_of(attempt + 1)
                        tasks = start()
                        await waited_or_ended(waiting, tasks)
                else:
                    # NOTE: the prefill that took the most of the case's prompts (it may have
                    # computed them all: the queued ones need one later).
                    took = {p.name: len(since(mark, p, "lease_granted")) for p in cluster.prefills}
                    victim = by_name(cluster, max(took, key=lambda n: took[n]))
                if cell.role != "decode":
                    fault.land_cell(cluster, cell, victim)
            elif is_prefill_phase:
                # NOTE: this process reads the prefills' logs a moment late: on a busy machine
                # the prompt it saw in prefill had its first token by the freeze, and no other
                # was left (seen beside two busy loops). The streams are then awaited and
                # started again with other prompts, twice at most.
                for attempt in range(3):
                    count = prefilling(cluster, mark)
                    await eventually(
                        lambda count=count: any(count().values()), 60, "a prompt in prefill"
                    )
                    async with frozen(cluster.prefills, fault):
                        held = await settled(count)
                        if any(held.values()) or attempt == 2:
                            computing = by_name(cluster, max(held, key=lambda n: held[n]))
                            assert held[computing.name] > 0, "no prompt was in prefill"
                            if cell.role == "gateway":
                                victim = gateway_of(cluster)
                            elif cell.role == "prefill":
                                victim = computing
                            else:
                                # NOTE: the decode whose lease that prefill is filling.
                                in_flight = {
                                    e["request_id"]: e["decode_instance_id"]
                                    for e in since(mark, computing, "lease_granted")
                                }
                                for e in since(mark, computing, "first_token"):
                                    in_flight.pop(e["request_id"], None)
                                decode_id = next(iter(in_flight.values()))
                                victim = next(
                                    d for d in cluster.decodes if instance_id(d) == decode_id
                                )
                            fault.land_cell(cluster, cell, victim)
                            break
                    await asyncio.gather(*tasks, return_exceptions=True)
                    mark = log_mark(cluster)
                    requests = requests_of(attempt + 1)
                    tasks = start()
            else:
                # NOTE: the first stream 10 tokens in: on a busy machine the others may end
                # before the slowest starts; the frozen decodes then hold what runs. A machine
                # busy enough ran every stream to its end before the decodes froze (this
                # process was not scheduled in between): the streams are awaited and started
                # again, twice at most.
                for attempt in range(3):
                    await asyncio.wait_for(is_streaming.wait(), REQUEST_TIMEOUT_S)
                    async with frozen(cluster.decodes, fault):
                        held = await settled(running_decodes(cluster, mark))
                        if any(held.values()) or attempt == 2:
                            serving = by_name(cluster, max(held, key=lambda n: held[n]))
                            assert held[serving.name] > 0, "no decode held a running stream"
                            if cell.phase == "cancelling":
                                for task in tasks:
                                    task.cancel()  # the client leaves while the decodes hold them
                                await asyncio.wait(tasks)
                            if cell.role == "gateway":
                                victim = gateway_of(cluster)
                            elif cell.role == "prefill":
                                computed = {
                                    p.name: len(since(mark, p, "first_token"))
                                    for p in cluster.prefills
                                }
                                victim = by_name(cluster, max(computed, key=lambda n: computed[n]))
                            else:
                                victim = serving
                            if cell.variant == "other_restarting":
                                # NOTE: the only other decode dies first and is on its way back.
                                assert cell.fault == "sigkill" and victim is serving
                                other = next(d for d in cluster.decodes if d is not serving)
                                fault.land_held(cluster, [other, serving])
                            else:
                                fault.land_cell(cluster, cell, victim)
                            break
                    await asyncio.gather(*tasks, return_exceptions=True)
                    mark = log_mark(cluster)
                    is_streaming.clear()
                    tasks = start()
            if cell.phase != "cancelling":
                expected_task = asyncio.ensure_future(asyncio.to_thread(undisturbed))
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            await fault.undo(cluster)
            if expected_task is not None and not expected_task.done():
                await asyncio.wait([expected_task])  # NOTE: its thread cannot be cancelled
    if expected_task is not None:
        expected = expected_task.result()
    elif all(isinstance(r, asyncio.CancelledError) for r in results):
        expected = [[] for _ in results]  # NOTE: nothing to compare
    else:
        expected = await asyncio.to_thread(undisturbed)
    outcomes = judge(list(results), expected, cell)
    # NOTE: in every built cell an instance of the victim's role is up or coming back, so a
    # stream the client did not cancel completes; a typed error would be a lost stream.
    assert not outcomes.typed_errors, outcomes.describe()
    if cell.variant == "other_restarting":
        came_back = await cluster.counter("pdserve_gateway_peer_waits", outcome="came_back")
        assert came_back > before_back, "no stream waited for a decode to come back"
    await eventually(lambda: gateway_sees_every_instance(cluster), 60, "every instance back")
    await cluster.wait_whole(timeout_s=20)
    restarted = await restarted_gateway_detail(cluster, fault)
    return outcomes.describe() + network_detail(cluster, mark, fault) + restarted + fault.felt


# ---- cells of a request no client is attached to: kept (background) and resuming -----------


async def land_while_decoding(
    cell: Cell, cluster: ProcessCluster, mark: dict[str, int], fault: Fault, is_last: bool
) -> bool:
    """Freezes the decodes, picks the victim of `cell.target` among the case's requests that
    run (the decode holding the most, or the prefill that computed the most), lands the
    fault, thaws the others. False (nothing landed) where every request had ended before the
    decodes froze (a busy machine did not schedule this process in between), unless
    `is_last`."""
    async with frozen(cluster.decodes, fault):
        held = await settled(running_decodes(cluster, mark))
        serving = by_name(cluster, max(held, key=lambda n: held[n]))
        if not any(held.values()) and not is_last:
            return False
        assert held[serving.name] > 0, "no decode held a running request"
        victim = serving
        if cell.role == "prefill":
            computed = {p.name: len(since(mark, p, "first_token")) for p in cluster.prefills}
            victim = by_name(cluster, max(computed, key=lambda n: computed[n]))
        elif cell.role == "gateway":
            victim = gateway_of(cluster)
        fault.land_cell(cluster, cell, victim)
    return True


async def run_unattached_cell(cell: Cell, cluster: ProcessCluster) -> str:
    """A ``kept`` cell (background responses, no client attached, read when done) or a
    ``resuming`` one (resumable chat streams the client left; the fault lands while it reads
    them again from where it was), each checked against the same requests run undisturbed."""
    await eventually(lambda: gateway_sees_every_instance(cluster), 60, "every instance up")
    await cluster.wait_whole(timeout_s=20)
    seeds = [100 + i for i in range(NUM_STREAMS)]
    unreadable: list[str] = []
    fault = Fault()
    async with (
        cluster.openai(timeout_s=REQUEST_TIMEOUT_S) as client,
        httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http,
    ):
        try:
            if cell.phase == "kept":
                bodies = [
                    {
                        "model": cluster.model_name,
                        "input": f"{cell.cell_id} {i}: tell me a story",
                        "max_output_tokens": UNATTACHED_MAX_TOKENS,
                        "temperature": 0.0 if i % 2 == 0 else 0.8,
                        "extra_body": {"seed": seed, "ignore_eos": True},
                    }
                    for i, seed in enumerate(seeds)
                ]

                async def all_ended(created: list[Any]) -> bool:
                    try:
                        got = [await client.responses.retrieve(c.id) for c in created]
                    except openai.APIConnectionError:
                        # NOTE: a killed gateway is on its way back.
                        assert cell.target == "gateway" and cell.fault == "sigkill"
                        return False
                    except openai.APIStatusError as error:
                        # NOTE: with the registry gone or cut off, the store of resumable
                        # requests (etcd) is too: a read is refused with a typed, retryable 503
                        # meanwhile.
                        assert cell.target == "registry" and error.status_code == 503, error
                        assert_no_transport_words(str(error.message))
                        unreadable.append(str(error.code))
                        return False
                    return all(g.status in ("completed", "incomplete", "failed") for g in got)

                done = await asyncio.gather(*(client.responses.create(**b) for b in bodies))
                expected = [d.output_text for d in done]
                # NOTE: on a busy machine every response may end before the decodes freeze;
                # the round is then read, checked and run again, twice at most.
                assert cluster.gateway is not None
                gateway = cluster.gateway
                for attempt in range(3):
                    mark = log_mark(cluster)
                    created = await asyncio.gather(
                        *(client.responses.create(**b, background=True) for b in bodies)
                    )
                    on_decodes = running_decodes(cluster, mark)

                    def decoding_or_ended(
                        on_decodes: Callable[[], dict[str, int]] = on_decodes,
                        mark: dict[str, int] = mark,
                    ) -> bool:
                        ended = since(mark, gateway, "request_finished")
                        return any(on_decodes().values()) or len(ended) >= len(bodies)

                    await eventually(
                        decoding_or_ended, REQUEST_TIMEOUT_S, "a background response decoding"
                    )
                    if await land_while_decoding(cell, cluster, mark, fault, attempt == 2):
                        break
                    await eventually(
                        lambda created=created: all_ended(created),
                        REQUEST_TIMEOUT_S,
                        "an undisturbed round",
                    )
                    got = [await client.responses.retrieve(c.id) for c in created]
                    assert [g.output_text for g in got] == expected, "an undisturbed round differs"

                await eventually(
                    lambda: all_ended(created), REQUEST_TIMEOUT_S, "every background response ended"
                )
                got = [await client.responses.retrieve(c.id) for c in created]
                assert [g.status for g in got] == ["incomplete"] * len(got), [g.error for g in got]
                texts = [g.output_text for g in got]
            else:
                assert cell.phase == "resuming"
                bodies = [
                    {
                        "model": cluster.model_name,
                        "messages": [{"role": "user", "content": f"{cell.cell_id} {i}: go on"}],
                        "max_tokens": UNATTACHED_MAX_TOKENS,
                        "temperature": 0.0 if i % 2 == 0 else 0.8,
                        "seed": seed,
                        "ignore_eos": True,
                        "stream": True,
                    }
                    for i, seed in enumerate(seeds)
                ]
                url = f"{cluster.rest_url}/v1/chat/completions"
                whole = await asyncio.gather(*(http.post(url, json=b) for b in bodies))
                expected = [chat_content(sse_events(w.text)) for w in whole]

                async def leave(body: dict[str, Any]) -> tuple[str, list[SseEvent]]:
                    resumable = {**body, "stream_options": {"resumable": True}}
                    return await left_after(http, url, resumable)

                async def resume(
                    stream_id: str, before: list[SseEvent], event: asyncio.Event
                ) -> str:
                    resume_url = f"{url}/chatcmpl-{stream_id}/stream"
                    after: list[SseEvent] = []
                    while not after or after[-1][1] != "[DONE]":
                        # NOTE: a killed gateway's client resumes again where it comes back,
                        # from the last event it got.
                        lines: list[str] = []
                        last = after[-1][0] if after else before[-1][0]
                        try:
                            params = {"starting_after": last}
                            async with http.stream("GET", resume_url, params=params) as again:
                                assert again.status_code == 200
                                async for line in again.aiter_lines():
                                    lines.append(line)
                                    event.set()
                        except httpx.TransportError:
                            assert cell.target == "gateway" and cell.fault == "sigkill"
                            await asyncio.sleep(0.1)
                        # NOTE: only whole events (a broken connection may cut the last one).
                        text = "\n".join(lines)
                        whole = text[: text.rfind("\n\n") + 1] if "\n\n" in text else ""
                        after += sse_events(whole if not text.endswith("\n") else text)
                        if after and after[-1][1] != "[DONE]":
                            assert cell.target == "gateway" and cell.fault == "sigkill", after[-3:]
                    return chat_content(before) + chat_content(after)

                # NOTE: on a busy machine every stream may end before the decodes freeze; the
                # round is then read, checked and run again, twice at most.
                for attempt in range(3):
                    mark = log_mark(cluster)
                    left = await asyncio.gather(*(leave(b) for b in bodies))
                    resuming = [asyncio.Event() for _ in left]
                    tasks = [
                        asyncio.create_task(resume(i, before, e))
                        for (i, before), e in zip(left, resuming, strict=True)
                    ]
                    await asyncio.wait_for(
                        asyncio.gather(*(e.wait() for e in resuming)), REQUEST_TIMEOUT_S
                    )
                    landed = await land_while_decoding(cell, cluster, mark, fault, attempt == 2)
                    texts = list(await asyncio.gather(*tasks))
                    if landed:
                        break
                    assert texts == expected, "an undisturbed round differs"
        finally:
            await fault.undo(cluster)
    assert texts == expected, "a request differs from its undisturbed run"
    await eventually(lambda: gateway_sees_every_instance(cluster), 60, "every instance back")
    await cluster.wait_whole(timeout_s=20)
    detail = f"{len(texts)} completed equal" + network_detail(cluster, mark, fault) + fault.felt
    detail += await restarted_gateway_detail(cluster, fault)
    if unreadable:
        detail += f"; {len(unreadable)} reads refused meanwhile ({unreadable[0]}, 503)"
    return detail


@pytest.mark.parametrize(
    "cell",
    [
        pytest.param(cell, id=cell.cell_id, marks=() if cell.fast else (pytest.mark.chaos,))
        for cell in BUILT
    ],
)
async def test_fault_matrix_cell(
    cell: Cell, request: pytest.FixtureRequest, reference: Reference, results_path: Path
) -> None:
    name = "split_matrix_cluster" if cell.is_rank else "matrix_cluster"
    if cell.fault in SERVER_FAULTS or (cell.fault, cell.target) == ("sigkill", "gateway"):
        # NOTE: a killed gateway's resumable requests outlive it in etcd.
        name = "servers_matrix_cluster"
    elif cell.fault == "disk_full":
        name = "disk_matrix_cluster"
    elif cell.fault in NETWORK_FAULTS:
        name = "net_servers_matrix_cluster" if cell.target in SERVER_HOSTS else "net_matrix_cluster"
    matrix_cluster: ProcessCluster = request.getfixturevalue(name)
    started = time.monotonic()
    try:
        if cell.phase in ("kept", "resuming"):
            detail = await run_unattached_cell(cell, matrix_cluster)
        else:
            detail = await run_cell(cell, matrix_cluster, reference)
    except BaseException as error:
        record(results_path, cell, "failed", time.monotonic() - started, repr(error)[:200])
        raise
    record(results_path, cell, "passed", time.monotonic() - started, detail)
