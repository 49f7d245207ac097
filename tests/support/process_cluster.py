"""Clusters of real service processes, started the way `pdserve up` starts them.

`ProcessCluster` is the launcher's `Cluster` (gateway, prefills and decodes as separate
processes on loopback, ports picked by the OS) plus what fault-injection tests need: extra
environment variables per process, instance addresses, the block-pool inspection RPC
(`InstanceService.GetInstanceStatus`), gateway and instance counters, and streaming clients that
compare token ids.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.pki import MEMBER_DNS_NAME
from pdserve.common.security import Security
from pdserve.launcher.child import ChildProcess
from pdserve.launcher.cluster import Cluster
from pdserve.launcher.config import ClusterConfig
from pdserve.launcher.forkserver import ForkServer, ForkServerError
from pdserve.v1 import common_pb2, instance_pb2, instance_pb2_grpc
from support.etcd_server import EtcdServer, running_etcd
from support.eventually import eventually
from support.ports import gateway_ports

STARTED_EVENTS = ("prefill_started", "decode_started")

_fork_server: ForkServer | None = None


def shared_fork_server(env: Mapping[str, str]) -> ForkServer | None:
    """This test process's fork server, started at the first call (with `env`; its log in a
    temp dir of its own), again if it was lost; None where it cannot start.

    `pdserve up` starts one per cluster; a test process that starts dozens of clusters shares
    one instead, so a cluster starts without importing torch and the services again (about
    4-7 s of CPU each on a 2-core machine). A forked service takes the environment its
    cluster gives it; the preloaded modules read none at import.
    """
    global _fork_server
    if _fork_server is not None and not _fork_server.is_lost:
        return _fork_server
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-test-fork-server-"))
    try:
        _fork_server = ForkServer(log_dir / "fork-server.log", dict(env))
    except ForkServerError:
        _fork_server = None
        return None
    atexit.register(_close_fork_server, _fork_server, log_dir)
    return _fork_server


def _close_fork_server(server: ForkServer, log_dir: Path) -> None:
    server.close()
    shutil.rmtree(log_dir, ignore_errors=True)


class ProcessCluster(Cluster):
    """A launcher `Cluster` whose processes may each get extra environment variables.

    Args:
        config: What to start (in tests, ports from `support.ports.gateway_ports` or 0).
        child_env: Extra variables per child name ("prefill-1", "decode-0", ...), e.g. a
            fault-injection switch for one instance only.
    """

    def __init__(
        self, config: ClusterConfig, child_env: Mapping[str, Mapping[str, str]] | None = None
    ) -> None:
        super().__init__(config)
        self._child_env = {name: dict(env) for name, env in (child_env or {}).items()}

    def _start_fork_server(self) -> None:
        """The test process's shared fork server (`shared_fork_server`), where the
        configuration asks for one."""
        if self.config.fork_server:
            self.fork_server = shared_fork_server(self.env)

    def stop(self, timeout_s: float = 30.0) -> None:
        """`Cluster.stop`, leaving the shared fork server running for the next cluster."""
        self.fork_server = None
        super().stop(timeout_s)

    def _spawn(self, name: str, module: str, args: list[str]) -> ChildProcess:
        base = self.env
        self.env = {**base, **self._child_env.get(name, {})}
        try:
            return super()._spawn(name, module, args)
        finally:
            self.env = base

    @property
    def instances(self) -> list[ChildProcess]:
        """Every prefill and decode process, alive or not."""
        return [*self.prefills, *self.decodes]

    def survivors(self) -> list[ChildProcess]:
        """Prefills and decodes whose process is still running."""
        return [child for child in self.instances if child.returncode is None]

    @property
    def model_name(self) -> str:
        """The served model name (what clients pass as ``model``)."""
        return str(started_event(self.decodes[0])["model"])

    def openai(self, timeout_s: float = 60.0) -> openai.AsyncOpenAI:
        """An SDK client for the gateway's REST API (no SDK-level retries)."""
        return openai.AsyncOpenAI(
            base_url=f"{self.rest_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s
        )

    async def counter(self, name: str, **labels: str) -> float:
        """Sum of a gateway counter's ``_total`` samples that carry `labels`."""
        return await counter_at(f"{self.rest_url}/metrics", name, **labels)

    async def instance_counter(self, child: ChildProcess, name: str, **labels: str) -> float:
        """Sum of a prefill's or decode's counter ``_total`` samples that carry `labels`
        (0 when the instance does not export it, e.g. the store's counters without a store)."""
        return await counter_at(metrics_url(child), name, **labels)

    def security(self, name: str = "client") -> Security:
        """The credentials `pdserve up` made for `name` (insecure when the cluster is)."""
        if self.tls_dir is None:
            return Security.insecure()
        files = self.tls[name]
        return Security.from_files(files.ca, files.cert, files.key)

    async def pool_status(
        self, target: str, timeout_s: float = 5.0
    ) -> instance_pb2.GetInstanceStatusResponse:
        """`InstanceService.GetInstanceStatus` with the block-pool integrity check (as the
        cluster's operator certificate)."""
        channel = self.security().channel(target, MEMBER_DNS_NAME)
        try:
            stub = instance_pb2_grpc.InstanceServiceStub(channel)
            request = instance_pb2.GetInstanceStatusRequest(check_integrity=True)
            return await stub.GetInstanceStatus(request, timeout=timeout_s)
        finally:
            await channel.close()

    async def wait_whole(self, timeout_s: float = 10.0) -> None:
        """Invariant 3 on every surviving instance, polled until it holds or time runs out.

        Raises:
            AssertionError: Naming each instance whose pool is inconsistent, not all free, or
                still has open leases when the time is up.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            problems = []
            for child in self.survivors():
                problem = pool_problem(await self.pool_status(address(child)))
                if problem:
                    problems.append(f"{child.name}: {problem}")
            if not problems:
                return
            if loop.time() > deadline:
                raise AssertionError("; ".join(problems))
            await asyncio.sleep(0.1)


ENV_TEST_KV_TRANSPORT = "PDSERVE_TEST_KV_TRANSPORT"
DEFAULT_NUM_BLOCKS = 1024  # an instance's pool unless a test sizes it: 16k tokens


def forced_kv_transport() -> str | None:
    """The KV transport every prefill of the test clusters must use (``make test-transports``
    runs the suites once per transport), or None for the default choice."""
    return os.environ.get(ENV_TEST_KV_TRANSPORT) or None


@contextlib.contextmanager
def running_cluster(
    model_dir: Path,
    log_dir: Path,
    *,
    child_env: Mapping[str, Mapping[str, str]] | None = None,
    stop_timeout_s: float = 10.0,
    dtype: str = "float32",
    **settings: Any,
) -> Iterator[ProcessCluster]:
    """Starts a `ProcessCluster` on loopback; stops it on exit. Its gateways' ports lie below
    the kernel's ephemeral range (`support.ports.gateway_ports`): a gateway restarted binds the
    ports it had, and one drawn from the range could meanwhile be another socket's.

    Args:
        model_dir: The model every instance serves.
        log_dir: Where each process's log goes.
        child_env: Extra environment per child name.
        stop_timeout_s: How long the processes may drain when the block ends.
        dtype: ``--dtype`` of every prefill and decode: float32 by default, as the references
            the tests compare with (transformers or the colocated engine) are float32.
        settings: Further `ClusterConfig` fields (prefills, decodes, *_args).
    """
    for role in ("prefill_args", "decode_args"):
        args = settings.get(role, "")
        if "--num-blocks" not in args and "--kv-cache-memory-fraction" not in args:
            # NOTE: a size, not the default share of free memory (GiBs for the real model):
            # allocating it is most of an instance's start, and no test here needs more.
            args = f"--num-blocks {DEFAULT_NUM_BLOCKS} {args}"
        settings[role] = f"--dtype {dtype} {args}".strip()
    forced = forced_kv_transport()
    if forced is not None:
        settings["prefill_args"] = f"{settings.get('prefill_args', '')} --kv-transports {forced}"
    port, grpc_port, internal_port = gateway_ports(int(settings.get("gateways", 1)))
    config = ClusterConfig(
        model=str(model_dir),
        host="127.0.0.1",
        port=port,
        grpc_port=grpc_port,
        internal_port=internal_port,
        log_dir=str(log_dir),
        startup_timeout_s=120,
        **settings,
    )
    cluster = ProcessCluster(config, child_env)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop(timeout_s=stop_timeout_s)


@contextlib.contextmanager
def running_cluster_on_etcd(
    model_dir: Path, tmp_path: Path, **settings: Any
) -> Iterator[tuple[ProcessCluster, EtcdServer]]:
    """A real etcd in `tmp_path` and a `running_cluster` (logs in ``tmp_path/logs``) whose
    instances and gateways share their registry through it; `settings` as there."""
    with (
        running_etcd(tmp_path) as etcd,
        running_cluster(model_dir, tmp_path / "logs", registry=etcd.spec, **settings) as started,
    ):
        yield started, etcd


def started_event(child: ChildProcess) -> dict[str, Any]:
    """The record a prefill or decode logs once it serves (it carries address and model)."""
    for record in child.events:
        if record.get("event") in STARTED_EVENTS:
            return record
    raise AssertionError(f"{child.name} never logged that it started")


def address(child: ChildProcess) -> str:
    """The gRPC address a prefill or decode process serves on."""
    return str(started_event(child)["address"])


def metrics_url(child: ChildProcess) -> str:
    """The ``/metrics`` URL of a prefill or decode process (from its start-up log)."""
    for record in child.events:
        if record.get("event") == "metrics_started":
            return f"http://{record['address']}/metrics"
    raise AssertionError(f"{child.name} never logged its metrics address")


async def counter_at(url: str, name: str, **labels: str) -> float:
    """Sum of the ``{name}_total`` samples that carry `labels` on a ``/metrics`` page."""
    return await sample_at(url, f"{name}_total", **labels)


async def sample_at(url: str, sample_name: str, **labels: str) -> float:
    """Sum of the samples named `sample_name` (a gauge's name, a counter's ``_total``) that
    carry `labels` on a ``/metrics`` page."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        text = (await http.get(url)).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == sample_name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def events_named(child: ChildProcess, event: str) -> list[dict[str, Any]]:
    """The records `child` logged so far with this event name."""
    return [record for record in list(child.events) if record.get("event") == event]


def pool_problem(status: instance_pb2.GetInstanceStatusResponse) -> str:
    """Why a pool is not whole (inconsistent, blocks not free, open leases), or ``""``."""
    pool: common_pb2.PoolIntegrity = status.pool
    if not pool.is_consistent:
        return f"inconsistent: {pool.detail}"
    if pool.num_free_blocks != pool.num_total_blocks or pool.num_open_leases:
        return (
            f"{pool.num_free_blocks}/{pool.num_total_blocks} blocks free, "
            f"{pool.num_leased_blocks} leased, {pool.num_open_leases} open leases"
        )
    return ""


async def stream_token_ids(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    on_tokens: Callable[[list[int]], None] | None = None,
    timeout_s: float = 60.0,
    **sampling: Any,
) -> list[int]:
    """Streams one completion and returns its token ids (``return_token_ids``).

    Args:
        client: The SDK client.
        model: Served model name.
        prompt: Text prompt.
        max_tokens: Completion length.
        on_tokens: Called with the ids so far after every chunk.
        timeout_s: The whole stream's bound (raises TimeoutError).
        sampling: temperature, top_p, seed, ... (``extra_body`` merged with the one that asks
            for the token ids)
    """
    ids: list[int] = []
    extra_body = {"return_token_ids": True, **sampling.pop("extra_body", {})}
    async with asyncio.timeout(timeout_s):
        chunks = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            extra_body=extra_body,
            **sampling,
        )
        async for chunk in chunks:
            for choice in chunk.choices:
                ids.extend((choice.model_extra or {}).get("token_ids") or ())
            if on_tokens is not None:
                on_tokens(ids)
    return ids


async def stream_choices(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    n: int,
    on_tokens: Callable[[list[int]], None] | None = None,
    timeout_s: float = 60.0,
    **sampling: Any,
) -> list[tuple[list[int], list[float]]]:
    """Streams `n` completions of one prompt with logprobs; returns each choice's token ids and
    their logprobs, by choice index (`on_tokens` sees every choice's ids so far, joined)."""
    ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    async with asyncio.timeout(timeout_s):
        chunks = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            n=n,
            stream=True,
            extra_body={"return_token_ids": True, **sampling.pop("extra_body", {})},
            **sampling,
        )
        async for chunk in chunks:
            for choice in chunk.choices:
                ids[choice.index].extend((choice.model_extra or {}).get("token_ids") or ())
                if choice.logprobs is not None:
                    values = choice.logprobs.token_logprobs or []
                    logprobs[choice.index].extend(v for v in values if v is not None)
            if on_tokens is not None:
                on_tokens([t for choice_ids in ids for t in choice_ids])
    return list(zip(ids, logprobs, strict=True))


def set_when_streaming(event: asyncio.Event, num_tokens: int = 10) -> Callable[[list[int]], None]:
    """An ``on_tokens`` callback that sets `event` once a stream has `num_tokens` tokens."""

    def on_tokens(ids: list[int]) -> None:
        if len(ids) >= num_tokens:
            event.set()

    return on_tokens


async def busiest_decode(cluster: ProcessCluster) -> tuple[ChildProcess, int]:
    """The decode with the most streams still running, and that count: requests whose lease
    it committed and the gateway has not finished. It comes back frozen (SIGSTOP), so none of
    those streams can end before the caller's fault lands; the other decodes run on."""
    # NOTE: read from the logs, not asked of the pools: two mTLS calls on a loaded machine
    # take long enough for a few hundred tiny-model tokens to end before the fault lands. The
    # logs are read as the children write them, a moment late: every decode is frozen while
    # they catch up, so a stream counted as running cannot finish between the count and the
    # fault (a short freeze, far below the gateway's stall timeout).
    assert cluster.gateway is not None
    victim: ChildProcess | None = None
    for decode in cluster.decodes:
        decode.signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5.0
        await asyncio.sleep(0.3)
        running: list[int] = []
        while True:
            # NOTE: the gateway runs on and its log may still lag behind a stream that ended
            # just before the freeze: a count is taken once it held for 0.3 s.
            finished = {e["request_id"] for e in events_named(cluster.gateway, "request_finished")}
            counted = [
                len({e["request_id"] for e in events_named(d, "lease_committed")} - finished)
                for d in cluster.decodes
            ]
            if (counted == running and max(running) > 0) or time.monotonic() > deadline:
                running = counted
                break
            running = counted
            await asyncio.sleep(0.3 if max(running) > 0 else 0.05)
        victim = cluster.decodes[running.index(max(running))]
    finally:
        for decode in cluster.decodes:
            if decode is not victim:
                decode.signal(signal.SIGCONT)
    return victim, max(running)


def num_committed(cluster: ProcessCluster) -> int:
    """Leases the cluster's decodes committed (a request decodes from then), from their logs."""
    return sum(len(events_named(d, "lease_committed")) for d in cluster.decodes)


async def greedy_streams_through_a_decode_kill(
    cluster: ProcessCluster,
    client: openai.AsyncOpenAI,
    prompts: list[str],
    max_tokens: int,
    alone: list[list[int]],
) -> list[list[int]]:
    """Greedy streams of `prompts` (``ignore_eos``), the decode holding the most of them
    SIGKILLed once the first of them decodes (its lease committed, read from the decodes' logs:
    a client reading behind the decodes on a busy machine saw first tokens only after whole
    streams had ended; and the test reads those logs late there too, so it freezes the decodes
    at the first commit it sees, not at the last, which came after every stream had ended in
    three tries beside two busy loops); their token ids once they end.

    When no decode held one at the count (a busy machine ran them all out first), they are
    checked against `alone` and started again, up to three times.
    """

    async def streaming() -> list[asyncio.Task[list[int]]]:
        wanted = num_committed(cluster) + 1
        tasks = [
            asyncio.create_task(
                stream_token_ids(
                    client, cluster.model_name, prompt, max_tokens=max_tokens, timeout_s=120,
                    temperature=0.0, extra_body={"ignore_eos": True},
                )
            )
            for prompt in prompts
        ]  # fmt: skip
        await eventually(lambda: num_committed(cluster) >= wanted, 60, "a stream decoding")
        return tasks

    for attempt in range(3):
        tasks = await streaming()
        victim, num_running = await busiest_decode(cluster)  # frozen: its streams run on
        if num_running > 0 or attempt == 2:
            break
        victim.signal(signal.SIGCONT)
        assert await asyncio.gather(*tasks) == alone
    victim.signal(signal.SIGKILL)
    assert num_running > 0, "no decode held a running stream"
    assert victim.wait(10) == -signal.SIGKILL
    return list(await asyncio.gather(*tasks))


async def streamed_until_preempted(
    cluster: ProcessCluster,
    client: openai.AsyncOpenAI,
    prompts: list[str],
    max_tokens: int,
    check: Callable[[list[list[int]]], None],
    **sampling: Any,
) -> None:
    """Streams `prompts` at once (``ignore_eos``) and `check`s their token ids, again (up to
    three rounds) until the gateway counted a preemption: a busy machine may serve them so
    staggered that none is preempted."""
    before = await cluster.counter("pdserve_gateway_reschedules", cause="preempted")
    for _ in range(3):
        check(
            await asyncio.gather(
                *(
                    stream_token_ids(
                        client, cluster.model_name, prompt, max_tokens=max_tokens,
                        timeout_s=120, extra_body={"ignore_eos": True}, **sampling,
                    )
                    for prompt in prompts
                )
            )
        )  # fmt: skip
        if await cluster.counter("pdserve_gateway_reschedules", cause="preempted") > before:
            return
    raise AssertionError(f"three rounds of {len(prompts)} streams preempted none")
