"""Chaos on real processes started like `pdserve up`: kill, freeze and starve instances.

Every test holds the design's invariants on separate gateway / prefill / decode processes:
outputs equal the undisturbed single-process engine token for token (greedy and seeded), and
afterwards every surviving instance's block pool is whole (consistent, all blocks free, no
open lease), checked with `InstanceService.GetInstanceStatus`. Everything binds loopback with
OS-picked ports, and every wait is bounded.

Which cluster a case gets:

- A fault that leaves every process running (a preemption storm, a store that breaks, a
  corrupt KV chunk, a lease nobody uses) runs on a cluster that the cases of its class share,
  one per configuration (`storm_pool`, `faulty_prefill_cluster`). Each such case finds every
  pool whole when it starts and leaves it whole, and reads only its own log lines
  (`log_mark`) and counter increments.
- A fault that kills or freezes a process gets a cluster of its own, and the request kinds go
  through that one fault together: plain greedy and seeded streams, streams of n choices with
  every sampling control on, and forced tool calls, each checked against its own reference.

The variants, and what each adds:

- Preemption storm (`test_preemption_storm`): on the dense demo with the store off, plain
  requests, every control with n choices (rescheduled logprobs, penalties, a constraint) and,
  on a pool sized for their ~710-token prompts, forced tool calls; with a ``file:`` store (a
  victim's full blocks are offloaded and its reschedule loads them); on the mixture-of-experts
  demo (a tiny Mixtral recomputes a rescheduled request token for token); and on a decode
  split over two ranks. The store that breaks mid-storm, and one choice of n preempted alone,
  share the storm pools.
- A decode lost mid-stream (`test_sigkill_decode_mid_stream`): SIGKILL of the process with
  every request kind at once on the dense demo, with plain requests on the mixture-of-experts
  demo, and SIGKILL of rank 1 of a decode split over two ranks (the instance goes down as a
  whole).
- A prefill killed mid-prefill, and a corrupt KV chunk: with the store off and with a
  ``file:`` store (the survivor, or the retry's healthy prefill, may load what the other one
  wrote through).
- A frozen decode, the silent-prefill lease and the load test (64 concurrent streaming
  clients, `NUM_REQUESTS_PER_CLIENT` requests each): store off. A lost decode's continuation
  meets the store exactly as a preempted one's does (the prefill reads what it wrote through;
  a decode writes the store only when it preempts), which the storm on the ``file:`` store
  checks with its counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import jsonschema
import openai
import pytest
from support.eventually import eventually
from support.process_cluster import (
    ProcessCluster,
    address,
    busiest_decode,
    events_named,
    num_committed,
    running_cluster,
    set_when_streaming,
    stream_choices,
    stream_token_ids,
)
from support.real_cluster import Reference

from pdserve.common.env import ENV_FAULT_CORRUPT_KV
from pdserve.common.errors import ErrorReason, from_rpc_error
from pdserve.common.pki import role_dns_name
from pdserve.launcher.child import ChildProcess
from pdserve.serving.convert import local_protocol
from pdserve.tokenizer.tokenizer import Tokenizer
from pdserve.v1 import decode_pb2, decode_pb2_grpc

# NOTE: the default pool (sized from free memory) is far more than these tests touch.
# NOTE: batch-invariant numerics (`--deterministic`) on every prefill and decode of a chaos
# cluster, and on its reference: a stream moved off a lost or preempted decode has its K/V
# recomputed by a prefill, whose attention sums in another order than the decode steps it
# replaces; only the mode promises the tokens after (docs/fault-matrix.md).
DETERMINISTIC = "--deterministic"
DECODE_ARGS = f"--num-blocks 1024 {DETERMINISTIC}"
PREFILL_ARGS = f"--num-blocks 512 {DETERMINISTIC}"
DECODE_TP2 = "--tensor-parallel-size 2 --num-threads 1"
GREEDY: dict[str, Any] = {"temperature": 0.0}
SEEDED: dict[str, Any] = {"temperature": 0.8, "top_p": 0.95}

STORES = ("off", "file")
BLOCK_SIZE = 16  # the instances' default


class References(dict[str, Reference]):
    """The undisturbed engine on each model (``dense``, ``moe``), built on first use."""

    def __init__(self, model_dirs: dict[str, Path]) -> None:
        super().__init__()
        self.model_dirs = model_dirs

    def __missing__(self, model: str) -> Reference:
        self[model] = Reference(self.model_dirs[model], deterministic=True)
        return self[model]


@pytest.fixture(scope="module")
def references(demo_model_dir: Path, demo_moe_model_dir: Path) -> References:
    return References({"dense": demo_model_dir, "moe": demo_moe_model_dir})


@pytest.fixture(scope="module")
def reference(references: References) -> Reference:
    return references["dense"]


@dataclasses.dataclass(frozen=True)
class ChaosCluster:
    """A started cluster and what a case needs beside it."""

    variant: str  # which configuration (a key of `DECODE_VARIANTS` or `STORM_POOLS`)
    cluster: ProcessCluster
    reference: Reference  # the undisturbed engine on the cluster's model
    store_dir: Path | None  # the ``file:`` store's directory, if the cluster has one


@contextlib.contextmanager
def chaos_cluster(
    model_dir: Path,
    log_dir: Path,
    store: str,
    tmp_path_factory: pytest.TempPathFactory,
    **settings: Any,
) -> Iterator[tuple[ProcessCluster, Path | None]]:
    """`running_cluster` with the `store` variant: nothing, or a ``file:`` store in a new
    directory that every prefill and decode opened (the cluster and that directory)."""
    if store == "off":
        with running_cluster(model_dir, log_dir, **settings) as cluster:
            yield cluster, None
        return
    store_dir = tmp_path_factory.mktemp("kv-store")
    spec = f"file:{store_dir}"
    with running_cluster(model_dir, log_dir, kv_store=spec, **settings) as cluster:
        for child in cluster.instances:
            assert [e["spec"] for e in events_named(child, "kv_store_opened")] == [spec]
        yield cluster, store_dir


@contextlib.asynccontextmanager
async def whole_before_and_after(cluster: ProcessCluster) -> AsyncIterator[None]:
    """A case on a shared cluster: every pool whole when it starts, and again when it ends."""
    await cluster.wait_whole()
    yield
    await cluster.wait_whole()


def log_mark(cluster: ProcessCluster) -> dict[str, int]:
    """How many records each process has logged so far (see `events_since`)."""
    return {child.name: len(child.events) for child in cluster.children}


def events_since(mark: dict[str, int], child: ChildProcess, event: str) -> list[dict[str, Any]]:
    """The records `child` logged with this event name after `mark` was taken."""
    records = list(child.events)[mark.get(child.name, 0) :]
    return [record for record in records if record.get("event") == event]


async def store_counter(cluster: ProcessCluster, role: str, name: str) -> float:
    """A ``pdserve_<role>_<name>`` counter summed over the role's surviving instances."""
    children = cluster.prefills if role == "prefill" else cluster.decodes
    return sum(
        [
            await cluster.instance_counter(child, f"pdserve_{role}_{name}")
            for child in children
            if child.returncode is None
        ]
    )


def cases(num: int, prefix: str = "The quick brown fox") -> list[tuple[str, dict[str, Any]]]:
    """`num` distinct prompts, alternately greedy and seeded."""
    return [
        (f"{prefix} number {i}", GREEDY if i % 2 == 0 else {**SEEDED, "seed": 1000 + i})
        for i in range(num)
    ]


async def expected_ids(
    reference: Reference, requests: list[tuple[str, dict[str, Any]]], max_tokens: int
) -> list[list[int]]:
    """What the undisturbed single-process engine produces (run off the event loop)."""

    def run() -> list[list[int]]:
        return reference.completions([(p, {**s, "max_tokens": max_tokens}) for p, s in requests])

    return await asyncio.to_thread(run)


# ---- the request kinds: every sampling control with n choices, forced tool calls ------------


# NOTE: penalties count every generated token, logprobs come from whichever instance computed
# the position, and each of n choices is its own stream: all of it must survive a reschedule.
CONTROLS: dict[str, Any] = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.3,
    "logprobs": 2,
    "logit_bias": {"101": 2.0, "32": -1.5},
    # NOTE: the demo model's vocabulary is bytes: the constraint keeps 29 of them.
    "extra_body": {"repetition_penalty": 1.2, "structured_outputs": {"regex": "[a-z ,.]+"}},
}
NUM_CHOICES = 3
LOGPROB_TOLERANCE = 1e-4


def controlled_cases(num: int, prefix: str) -> list[tuple[str, dict[str, Any]]]:
    """`num` prompts with every control on, alternately greedy and seeded."""
    return [(prompt, {**sampling, **CONTROLS}) for prompt, sampling in cases(num, prefix)]


async def undisturbed(
    cluster: ProcessCluster, requests: list[tuple[str, dict[str, Any]]], max_tokens: int
) -> list[list[tuple[list[int], list[float]]]]:
    """Each request alone on the cluster, one after the other: nothing preempts them."""
    before = await cluster.counter("pdserve_gateway_reschedules", cause="preempted")
    async with cluster.openai() as client:
        results = [
            await stream_choices(
                client, cluster.model_name, prompt, max_tokens=max_tokens, n=NUM_CHOICES,
                **copy.deepcopy(sampling),
            )
            for prompt, sampling in requests
        ]  # fmt: skip
    assert await cluster.counter("pdserve_gateway_reschedules", cause="preempted") == before
    return results


def assert_same_choices(
    results: list[list[tuple[list[int], list[float]]]],
    expected: list[list[tuple[list[int], list[float]]]],
) -> None:
    """Token for token equal, logprobs equal to float noise (a position recomputed by a
    prefill pass instead of a decode step)."""
    assert [[ids for ids, _ in r] for r in results] == [[ids for ids, _ in e] for e in expected]
    for result, reference in zip(results, expected, strict=True):
        for (ids, logprobs), (_, expected_logprobs) in zip(result, reference, strict=True):
            assert len(logprobs) == len(ids)
            assert logprobs == pytest.approx(expected_logprobs, abs=LOGPROB_TOLERANCE)


def assert_constrained(results: list[list[tuple[list[int], list[float]]]], model_dir: Path) -> None:
    """Every choice's text is what CONTROLS' constraint allows."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    allowed = re.compile(CONTROLS["extra_body"]["structured_outputs"]["regex"])
    for result in results:
        for ids, _ in result:
            text = tokenizer.decode([t for t in ids if t not in tokenizer.eos_token_ids])
            assert allowed.fullmatch(text), text


LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Looks a word up.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 160, "maxLength": 200},
                "limit": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["query", "limit"],
            "additionalProperties": False,
        },
    },
}


async def stream_tool_calls(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    on_tokens: Callable[[list[int]], None] | None = None,
    timeout_s: float = 60.0,
    **sampling: Any,
) -> tuple[list[int], str | None, list[tuple[str, str]]]:
    """Streams one chat completion forced to call LOOKUP: (token ids, finish reason, the
    calls as (name, arguments) assembled from the deltas)."""
    ids: list[int] = []
    calls: dict[int, list[str]] = {}
    finish = None
    async with asyncio.timeout(timeout_s):
        chunks = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            tools=[LOOKUP],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=False,  # NOTE: one call: a random model never ends a list
            max_tokens=max_tokens,
            stream=True,
            extra_body={"return_token_ids": True},
            **sampling,
        )
        async for chunk in chunks:
            for choice in chunk.choices:
                ids.extend((choice.model_extra or {}).get("token_ids") or ())
                for call in choice.delta.tool_calls or ():
                    name, arguments = calls.setdefault(call.index, ["", ""])
                    function = call.function
                    calls[call.index] = [
                        name + ((function.name or "") if function else ""),
                        arguments + ((function.arguments or "") if function else ""),
                    ]
                finish = choice.finish_reason or finish
            if on_tokens is not None:
                on_tokens(ids)
    return ids, finish, [(name, arguments) for name, arguments in calls.values()]


def assert_valid_calls(
    results: list[tuple[list[int], str | None, list[tuple[str, str]]]], min_ended: int = 0
) -> None:
    """A call that ended (not cut by max_tokens) names LOOKUP with arguments that fit it; at
    least `min_ended` did."""
    ended = [r for r in results if r[1] == "tool_calls"]
    assert len(ended) >= min_ended, [r[1] for r in results]
    for _, _, calls in ended:
        assert calls and all(name == "lookup" for name, _ in calls)
        for _, arguments in calls:
            jsonschema.validate(json.loads(arguments), LOOKUP["function"]["parameters"])


OnTokens = Callable[[list[int]], None] | None


class Workload(NamedTuple):
    """Requests of one kind, ready to stream: one starter per request (client, on_tokens),
    how many tokens mean a stream is decoding, and the check of their results in order."""

    starters: list[Callable[[openai.AsyncOpenAI, OnTokens], Awaitable[Any]]]
    num_decoding_tokens: int
    check: Callable[[list[Any]], None]


PLAIN, EVERY_CONTROL, FORCED_TOOL_CALLS = "plain", "every_control", "forced_tool_calls"


async def workload(
    target: ChaosCluster, kind: str, *, prefix: str, max_tokens: int, timeout_s: float = 60.0
) -> Workload:
    """The requests of `kind` and their references: the single-process engine's tokens for
    plain requests, each request alone on the undisturbed cluster for the other kinds."""
    cluster, model = target.cluster, target.cluster.model_name

    def starter(
        stream: Callable[..., Awaitable[Any]], prompt: str, sampling: dict[str, Any], **kw: Any
    ) -> Callable[[openai.AsyncOpenAI, OnTokens], Awaitable[Any]]:
        def start(client: openai.AsyncOpenAI, on_tokens: OnTokens) -> Awaitable[Any]:
            return stream(
                client, model, prompt, max_tokens=max_tokens, on_tokens=on_tokens,
                timeout_s=timeout_s, **kw, **copy.deepcopy(sampling),
            )  # fmt: skip

        return start

    if kind == PLAIN:
        requests = cases(4, prefix)
        expected = await expected_ids(target.reference, requests, max_tokens)

        def check_plain(results: list[Any]) -> None:
            assert results == expected

        starters = [starter(stream_token_ids, p, s) for p, s in requests]
        return Workload(starters, 10, check_plain)
    if kind == EVERY_CONTROL:
        controlled = controlled_cases(2, f"Controlled {prefix}")
        expected_choices = await undisturbed(cluster, controlled, max_tokens)

        def check_choices(results: list[Any]) -> None:
            assert_same_choices(results, expected_choices)
            assert_constrained(results, target.reference.model_dir)

        starters = [starter(stream_choices, p, s, n=NUM_CHOICES) for p, s in controlled]
        return Workload(starters, 10 * NUM_CHOICES, check_choices)
    assert kind == FORCED_TOOL_CALLS
    requests = cases(4, f"Look up {prefix}")
    async with cluster.openai() as client:
        expected_calls = [
            await stream_tool_calls(client, model, p, max_tokens=max_tokens, **s)
            for p, s in requests
        ]

    def check_calls(results: list[Any]) -> None:
        assert results == expected_calls
        assert_valid_calls(results, min_ended=len(results))

    return Workload([starter(stream_tool_calls, p, s) for p, s in requests], 5, check_calls)


# ---- SIGKILL a decode (or one rank of it) mid-stream -----------------------------------------

DECODE_VARIANTS = {
    "dense": ("dense", DECODE_ARGS),
    "moe": ("moe", DECODE_ARGS),
    "split-decode": ("dense", f"{DECODE_ARGS} {DECODE_TP2}"),
}


@pytest.fixture
def two_decodes(
    request: pytest.FixtureRequest,
    references: References,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ChaosCluster]:
    """Two decodes (``dense``, ``moe``, or ``split-decode``: two ranks each) and a prefill."""
    model, decode_args = DECODE_VARIANTS[request.param]
    reference = references[model]
    with chaos_cluster(
        reference.model_dir,
        tmp_path,
        "off",
        tmp_path_factory,
        decodes=2,
        prefill_args=PREFILL_ARGS,
        decode_args=decode_args,
    ) as (cluster, store_dir):
        yield ChaosCluster(request.param, cluster, reference, store_dir)


@pytest.mark.parametrize(
    ("two_decodes", "kinds"),
    [
        pytest.param(
            "dense", (PLAIN, EVERY_CONTROL, FORCED_TOOL_CALLS),
            id="dense-plain-with_every_control-with_forced_tool_calls",
        ),
        pytest.param("moe", (PLAIN,), id="moe-plain"),
        pytest.param("split-decode", (PLAIN,), id="rank_of_a_split_decode-plain"),
    ],
    indirect=["two_decodes"],
)  # fmt: skip
async def test_sigkill_decode_mid_stream(two_decodes: ChaosCluster, kinds: tuple[str, ...]) -> None:
    cluster, max_tokens = two_decodes.cluster, 300
    is_split = two_decodes.variant == "split-decode"
    loads = [
        await workload(two_decodes, kind, prefix="Migration", max_tokens=max_tokens, timeout_s=120)
        for kind in kinds
    ]

    async def streaming(client: openai.AsyncOpenAI) -> list[asyncio.Task[Any]]:
        """Every load's streams, each past its first tokens, so the victim's streams are all
        decoding (a request still in prefill would fail over as a prefill error, not as a
        lost decode). The kinds start one after the other, the last first, each once the one
        before it streams: forced tool calls decode slowly under their grammar and plain
        streams end within seconds."""
        started: dict[int, list[asyncio.Task[Any]]] = {}
        for index in reversed(range(len(loads))):
            load = loads[index]
            events = [asyncio.Event() for _ in load.starters]
            committed = num_committed(cluster)
            started[index] = [
                asyncio.create_task(
                    start(client, set_when_streaming(event, load.num_decoding_tokens))
                )
                for start, event in zip(load.starters, events, strict=True)
            ]
            if index > 0:
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
                continue
            # NOTE: the last kind started decodes once its decodes committed their leases (read
            # from their logs): its first tokens seen by this client would come too late on a
            # busy machine, where the client reads behind the decodes and a 300-token stream
            # could end before the count.
            wanted = committed + len(load.starters)

            def decoding(wanted: int = wanted) -> bool:
                return num_committed(cluster) >= wanted

            await eventually(decoding, 60, "the last streams decoding")
        return [task for index in range(len(loads)) for task in started[index]]

    def check(results: list[Any]) -> None:
        done = 0
        for load in loads:
            load.check(results[done : done + len(load.starters)])
            done += len(load.starters)

    async with cluster.openai(timeout_s=120) as client:
        for attempt in range(3):
            tasks = await streaming(client)
            victim, num_running = await busiest_decode(cluster)  # frozen: its streams run on
            if num_running > 0 or attempt == 2:
                break
            # NOTE: a busy machine ran every stream to its end before the count: they are
            # checked, and the streams start again.
            victim.signal(signal.SIGCONT)
            check(await asyncio.gather(*tasks))
        if is_split:
            (rank_one,) = events_named(victim, "tensor_parallel_ready")[0]["pids"]
            os.kill(rank_one, signal.SIGKILL)
            victim.signal(signal.SIGCONT)
        else:
            victim.signal(signal.SIGKILL)
        assert num_running > 0, "no decode held a running stream"
        assert not all(task.done() for task in tasks), "the streams ended before the kill"
        if is_split:
            # NOTE: the lost rank takes its instance down as a whole: rank 0 stops and exits.
            assert victim.wait(30) == 1
            assert events_named(victim, "instance_down")
        else:
            assert victim.wait(10) == -signal.SIGKILL

        results = await asyncio.gather(*tasks)
        check(results)
        assert await cluster.counter("pdserve_gateway_reschedules", cause="decode_lost") >= 1
        await cluster.wait_whole()
        # The cluster keeps serving on the surviving decode.
        assert await loads[0].starters[1](client, None) == results[1]
    await cluster.wait_whole()


# ---- SIGKILL a prefill mid-prefill -----------------------------------------------------------


SIGKILL_PREFILL_LEASE_TTL_S = 15.0


@pytest.fixture(params=STORES)
def two_prefills(
    request: pytest.FixtureRequest,
    demo_model_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ProcessCluster]:
    # NOTE: a 16-token budget per forward pass makes a 1,200-token prompt take many passes, so
    # the kill lands while prompts are being computed and their KV shipped layer by layer.
    # With a store, the survivor may load what the victim wrote through before it died.
    # The lease TTL bounds how long a lease the victim took before it opened its SyncCache
    # stream stays open; it must also outlast the survivor computing every prompt at 16 tokens
    # a pass on a busy machine (a lease it takes expires otherwise: LEASE_EXPIRED, retried
    # until the request's attempts run out).
    with chaos_cluster(
        demo_model_dir,
        tmp_path,
        request.param,
        tmp_path_factory,
        prefills=2,
        prefill_args=f"{PREFILL_ARGS} --max-num-batched-tokens 16",
        decode_args=f"{DECODE_ARGS} --lease-ttl-ms {SIGKILL_PREFILL_LEASE_TTL_S * 1000:.0f}",
    ) as (cluster, _):
        yield cluster


async def test_sigkill_prefill_mid_prefill(
    two_prefills: ProcessCluster, reference: Reference
) -> None:
    cluster, max_tokens = two_prefills, 16
    filler = "pack my box with five dozen liquor jugs " * 30
    # NOTE: a prefill can finish both prompts it leased blocks for between the test seeing the
    # lease and the kill (a quick machine: tens of milliseconds); such a round is sent again
    # with new prompts (up to three times), the victim started again first.
    for round_ in range(3):
        requests = [
            (f"{round_}-{i} {filler}"[:1200], sampling) for i, (_, sampling) in enumerate(cases(4))
        ]
        expected = await expected_ids(reference, requests, max_tokens)
        mark = log_mark(cluster)
        async with cluster.openai() as client:
            tasks = [
                asyncio.create_task(
                    stream_token_ids(
                        client, cluster.model_name, prompt, max_tokens=max_tokens, **sampling
                    )
                )
                for prompt, sampling in requests
            ]

            def has_leased(mark: dict[str, int] = mark) -> bool:
                return any(events_since(mark, p, "lease_granted") for p in cluster.prefills)

            await eventually(has_leased, 30, "a prefill to lease decode blocks for a prompt")
            victim = next(p for p in cluster.prefills if events_since(mark, p, "lease_granted"))
            victim.signal(signal.SIGKILL)
            assert victim.wait(10) == -signal.SIGKILL
            leased = {e["request_id"] for e in events_since(mark, victim, "lease_granted")}
            first_tokens = {e["request_id"] for e in events_since(mark, victim, "first_token")}
            results = await asyncio.gather(*tasks)
        assert results == expected
        if leased - first_tokens:
            break
        cluster.restart(victim).wait_for_event("registered", 60)
    else:
        raise AssertionError("in three rounds the victim had finished every prompt it leased")
    assert await cluster.counter("pdserve_gateway_retries", reason="PEER_UNAVAILABLE") >= 1
    # The dead prefill's leases on the decode end too (broken SyncCache stream, or the TTL).
    await cluster.wait_whole(timeout_s=SIGKILL_PREFILL_LEASE_TTL_S + 10)


# ---- SIGSTOP a decode ------------------------------------------------------------------------

# NOTE: a safety net: the frozen decode's stream moves after INSTANCE_TTL_S, and new requests
# leave it after the prefill's 1.5 s AllocateBlocks timeout; anything left waiting on the frozen
# decode fails at this timeout. It also bounds the whole 600-token stream: a busy machine needs
# far more than 12 s for it.
REQUEST_TIMEOUT_S = 60.0
INSTANCE_TTL_S = 2.0


@pytest.fixture
def frozen_decode_cluster(demo_model_dir: Path, tmp_path: Path) -> Iterator[ProcessCluster]:
    # NOTE: a frozen decode stops heartbeating: the gateway drops it after 2 s and moves the
    # streams that depend on it. It also stops answering AllocateBlocks (the prefill gives up
    # after 1.5 s with PEER_UNAVAILABLE and the gateway tries another decode).
    with running_cluster(
        demo_model_dir,
        tmp_path,
        decodes=2,
        prefill_args=f"{PREFILL_ARGS} --allocate-timeout-ms 1500",
        decode_args=f"{DECODE_ARGS} --lease-ttl-ms 3000",
        gateway_args=f"--request-timeout {REQUEST_TIMEOUT_S} --heartbeat-interval-s 0.5 "
        f"--instance-ttl-s {INSTANCE_TTL_S}",
    ) as cluster:
        try:
            yield cluster
        finally:
            for child in cluster.decodes:
                child.signal(signal.SIGCONT)


async def test_sigstop_decode(frozen_decode_cluster: ProcessCluster, reference: Reference) -> None:
    cluster = frozen_decode_cluster
    long_max_tokens, max_tokens = 600, 24
    long_prompt = "A long story about a frozen decode"
    requests = cases(6, prefix="Requests while a decode is frozen")
    long_expected = (await expected_ids(reference, [(long_prompt, GREEDY)], long_max_tokens))[0]
    expected = await expected_ids(reference, requests, max_tokens)
    is_streaming = asyncio.Event()
    arrivals: list[float] = []
    on_streaming = set_when_streaming(is_streaming)

    def on_tokens(ids: list[int]) -> None:
        arrivals.append(time.monotonic())
        on_streaming(ids)

    async with cluster.openai(timeout_s=REQUEST_TIMEOUT_S + 10) as client:
        long_task = asyncio.create_task(
            stream_token_ids(
                client,
                cluster.model_name,
                long_prompt,
                max_tokens=long_max_tokens,
                on_tokens=on_tokens,
                timeout_s=REQUEST_TIMEOUT_S + 10,
                **GREEDY,
            )
        )
        await asyncio.wait_for(is_streaming.wait(), 30)
        victim, num_running = await busiest_decode(cluster)  # left frozen
        assert num_running > 0 and not long_task.done()

        # New requests move to the other decode, well within the request timeout.
        results = await asyncio.gather(
            *(
                stream_token_ids(
                    client,
                    cluster.model_name,
                    prompt,
                    max_tokens=max_tokens,
                    timeout_s=REQUEST_TIMEOUT_S,
                    **sampling,
                )
                for prompt, sampling in requests
            )
        )
        assert results == expected

        # The stream that was on the frozen decode moves once the decode misses its
        # heartbeats, and ends exactly as an undisturbed run (a stream left on the frozen
        # decode would have failed at the request timeout).
        long_ids = await long_task
        assert long_ids == long_expected
        # The client saw one stall: the 2 s TTL, a sweep, and the continuation's prefill (not
        # asserted: a busy machine stretches it).
        longest_gap_s = max(b - a for a, b in itertools.pairwise(arrivals))
        print(f"longest token gap of the moved stream: {longest_gap_s:.2f} s")
        assert await cluster.counter("pdserve_gateway_reschedules", cause="decode_lost") >= 1

    victim.signal(signal.SIGCONT)
    # The thawed decode finds its stream cancelled and releases the lease; it registers again.
    await cluster.wait_whole(timeout_s=15)


# ---- preemption storms: tiny decode pools under many concurrent streams ----------------------


# NOTE: 40 blocks of 16 tokens and no growth headroom: 16 two-block prompts fit, their
# growth to up to 6 blocks each does not, so running streams keep preempting each other.
TINY_DECODE_ARGS = f"--num-blocks 40 --reserve-tokens 0 {DETERMINISTIC}"
# NOTE: a forced call's prompt (the tool listed in the system message) is 731 byte tokens:
# the gateway books 48 blocks for each (the prompt and a 32-token headroom), the decode leases
# 46 and a call (64 tokens: its query has 160 or more characters, cut there) grows each to 50,
# so two that run at once in 98 blocks preempt each other. Not 96, which two bookings fill
# exactly: a load report taken while a call had grown past its booking (to 49 or 50 blocks)
# leaves the gateway 1-2 blocks short once the call ends (it takes off what it booked), so it
# sent one call at a time until the next report, and a busy run preempted nothing in 3 storms.
TOOL_DECODE_ARGS = f"--num-blocks 98 --reserve-tokens 0 {DETERMINISTIC}"
STORM_POOLS: dict[str, tuple[str, str, str]] = {  # name: (model, store, decode args)
    "dense": ("dense", "off", TINY_DECODE_ARGS),
    "dense-store": ("dense", "file", TINY_DECODE_ARGS),
    "moe": ("moe", "off", TINY_DECODE_ARGS),
    "split-decode": ("dense", "off", f"{TINY_DECODE_ARGS} {DECODE_TP2}"),
    "tool-sized": ("dense", "off", TOOL_DECODE_ARGS),
}
STORM_MAX_TOKENS = 64


@pytest.fixture(scope="class")
def storm_pool(
    request: pytest.FixtureRequest,
    references: References,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ChaosCluster]:
    """One decode with a tiny pool (`STORM_POOLS`), shared by the cases of its class."""
    model, store, decode_args = STORM_POOLS[request.param]
    reference = references[model]
    with chaos_cluster(
        reference.model_dir,
        tmp_path_factory.mktemp(f"storm-{request.param}-logs"),
        store,
        tmp_path_factory,
        prefill_args=PREFILL_ARGS,
        decode_args=decode_args,
        gateway_args="--preempt-retry-count 100",
    ) as (cluster, store_dir):
        yield ChaosCluster(request.param, cluster, reference, store_dir)


@pytest.fixture
async def storm(storm_pool: ChaosCluster) -> AsyncIterator[ChaosCluster]:
    async with whole_before_and_after(storm_pool.cluster):
        yield storm_pool


async def stream_all(
    cluster: ProcessCluster, requests: list[tuple[str, dict[str, Any]]]
) -> list[list[int]]:
    """Streams every request at once (token ids of each)."""
    async with cluster.openai() as client:
        return await asyncio.gather(
            *(
                stream_token_ids(
                    client, cluster.model_name, prompt, max_tokens=STORM_MAX_TOKENS, **sampling
                )
                for prompt, sampling in requests
            )
        )


async def plain_storm(storm: ChaosCluster) -> None:
    cluster = storm.cluster
    requests = cases(16, prefix="Storm")
    expected = await expected_ids(storm.reference, requests, STORM_MAX_TOKENS)
    reschedules = await cluster.counter("pdserve_gateway_reschedules", cause="preempted")
    offloads = await store_counter(cluster, "decode", "kv_offloads_written")
    loaded = await store_counter(cluster, "prefill", "store_loaded_prompt_tokens")

    # NOTE: as with the other storms: on a busy machine the streams may not overlap long enough
    # to preempt; a storm that preempted nothing goes again (at most 3 times).
    for _ in range(3):
        assert await stream_all(cluster, requests) == expected
        if await cluster.counter("pdserve_gateway_reschedules", cause="preempted") > reschedules:
            break
    assert await cluster.counter("pdserve_gateway_reschedules", cause="preempted") > reschedules
    if storm.store_dir is not None:
        # A victim's notice waits for the offload of its full blocks; its reschedule (prompt
        # and tokens so far) finds those the prefill never computed, the generated tokens',
        # in the store instead of computing them.
        assert await store_counter(cluster, "decode", "kv_offloads_written") > offloads
        now_loaded = await store_counter(cluster, "prefill", "store_loaded_prompt_tokens")
        assert now_loaded - loaded >= BLOCK_SIZE


async def storm_with_every_control(storm: ChaosCluster) -> None:
    cluster = storm.cluster
    requests = controlled_cases(6, prefix="Controlled storm")
    expected = await undisturbed(cluster, requests, STORM_MAX_TOKENS)
    before = await cluster.counter("pdserve_gateway_reschedules", cause="preempted")
    async with cluster.openai() as client:
        # NOTE: as with the forced tool calls: on a busy machine the requests may not overlap
        # long enough to preempt; a storm that preempted nothing goes again (at most 3 times).
        for _ in range(3):
            results = await asyncio.gather(
                *(
                    stream_choices(
                        client, cluster.model_name, prompt, max_tokens=STORM_MAX_TOKENS,
                        n=NUM_CHOICES, **copy.deepcopy(sampling),
                    )
                    for prompt, sampling in requests
                )
            )  # fmt: skip
            assert_same_choices(results, expected)
            assert_constrained(results, storm.reference.model_dir)
            if await cluster.counter("pdserve_gateway_reschedules", cause="preempted") > before:
                break
    assert await cluster.counter("pdserve_gateway_reschedules", cause="preempted") > before


async def storm_with_forced_tool_calls(storm: ChaosCluster) -> None:
    cluster = storm.cluster
    requests = cases(8, prefix="Look something up")
    async with cluster.openai() as client:
        expected = [
            await stream_tool_calls(client, cluster.model_name, p, max_tokens=STORM_MAX_TOKENS, **s)
            for p, s in requests
        ]
        before = await cluster.counter("pdserve_gateway_reschedules", cause="preempted")
        # NOTE: whether two calls overlap long enough to preempt is up to timing: a storm
        # that preempted nothing tested nothing, and goes again (at most 3 times).
        for _ in range(3):
            results = await asyncio.gather(
                *(
                    stream_tool_calls(
                        client, cluster.model_name, p, max_tokens=STORM_MAX_TOKENS, **s
                    )
                    for p, s in requests
                )
            )
            assert results == expected
            assert_valid_calls(results)
            if await cluster.counter("pdserve_gateway_reschedules", cause="preempted") > before:
                break
    assert await cluster.counter("pdserve_gateway_reschedules", cause="preempted") > before


STORMS: dict[str, Callable[[ChaosCluster], Awaitable[None]]] = {
    PLAIN: plain_storm,
    EVERY_CONTROL: storm_with_every_control,
    FORCED_TOOL_CALLS: storm_with_forced_tool_calls,
}

# NOTE: 40 blocks, as every storm pool. A long greedy request (a 20-block prompt) grows to 28
# blocks; a request of n=4 completions of a 44-token prompt needs up to 22 (its 2 full prompt
# blocks once, 5 of its own per choice), so it fits alone (no 400 for n), but not beside the
# long one. The decode preempts the newest running request first: a later choice of the n,
# never their first one nor the long request (28 + 7 blocks always fit).
CHOICE_PROMPT = "Choices share this prompt: tide shell kelp."  # 2 full blocks and a partial one
LONG_PROMPT = "A long story begins." + " once upon a time" * 18


class TestPreemption:
    """Faults that leave every process running, on tiny decode pools shared per class."""

    @pytest.mark.parametrize(
        ("storm_pool", "kind"),
        [
            pytest.param("dense", PLAIN, id="dense-plain"),
            pytest.param("dense", EVERY_CONTROL, id="dense-with_every_control"),
            pytest.param("tool-sized", FORCED_TOOL_CALLS, id="dense-with_forced_tool_calls"),
            pytest.param("dense-store", PLAIN, id="dense-store-plain"),
            pytest.param("moe", PLAIN, id="moe-plain"),
            pytest.param("split-decode", PLAIN, id="split_decode-plain"),
        ],
        indirect=["storm_pool"],
        scope="class",  # NOTE: the cases of one pool run one after the other, on one cluster
    )
    async def test_preemption_storm(self, storm: ChaosCluster, kind: str) -> None:
        await STORMS[kind](storm)

    @pytest.mark.parametrize("storm_pool", ["dense-store"], indirect=True)
    async def test_preemption_storm_while_the_store_breaks(self, storm: ChaosCluster) -> None:
        cluster, decode = storm.cluster, storm.cluster.decodes[0]
        assert storm.store_dir is not None
        # NOTE: tests run as root, whom `chmod 000` does not stop: the store's directory is
        # moved away and a regular file takes its place, so every read, write and mkdir under
        # it fails. It comes back at the end, for the cases that share the pool.
        root, gone = storm.store_dir, storm.store_dir.with_name(f"{storm.store_dir.name}-gone")
        requests = cases(16, prefix="Breaking storm")
        expected = await expected_ids(storm.reference, requests, STORM_MAX_TOKENS)
        mark = log_mark(cluster)
        skipped_before = await store_counter(cluster, "decode", "kv_offloads_skipped")
        errors_before = {
            role: await store_counter(cluster, role, "kv_store_errors")
            for role in ("decode", "prefill")
        }
        wave = asyncio.create_task(stream_all(cluster, requests))

        def has_offloaded() -> bool:
            return bool(events_since(mark, decode, "kv_offload_written")) or wave.done()

        await eventually(has_offloaded, 30, "a preempted request's offload to land")
        root.rename(gone)
        try:
            root.write_bytes(b"not a directory")
            assert await wave == expected

            # Every preemption from now on meets the broken store: the offload fails, the
            # notice goes without a stored prefix and the reschedule computes everything again.
            # NOTE: a wave whose streams a busy machine admits far enough apart may preempt
            # nothing; up to three waves, each token for token, until one does.
            reschedules = await cluster.counter("pdserve_gateway_reschedules", cause="preempted")
            for attempt in range(3):
                later = cases(16, prefix=f"Gone {attempt}")
                expected_later = await expected_ids(storm.reference, later, STORM_MAX_TOKENS)
                assert await stream_all(cluster, later) == expected_later
                now = await cluster.counter("pdserve_gateway_reschedules", cause="preempted")
                if now > reschedules:
                    break
            assert now > reschedules, "three storms on the broken store preempted nothing"
            skipped = events_since(mark, decode, "kv_offload_skipped")
            assert skipped and {e["cause"] for e in skipped} == {"store_error"}
            assert await store_counter(cluster, "decode", "kv_offloads_skipped") > skipped_before
            for role, before in errors_before.items():
                assert await store_counter(cluster, role, "kv_store_errors") > before, role
        finally:
            root.unlink(missing_ok=True)
            gone.rename(root)

    @pytest.mark.parametrize("storm_pool", ["dense"], indirect=True)
    async def test_preempting_one_choice_reschedules_that_choice_alone(
        self, storm: ChaosCluster
    ) -> None:
        cluster, reference = storm.cluster, storm.reference
        # NOTE: the long stream ends at 507 tokens (32 of the pool's 40 blocks): the choices
        # start once it streams, and however late a busy machine lets them, they outgrow what
        # it leaves them while it still runs; choice 0 (7 blocks at its end) always fits beside
        # it, so only a later choice is ever the victim.
        n, choice_tokens, long_tokens = 4, 64, 180
        seeded = {**SEEDED, "seed": 77}
        assert len(reference.tokenizer.encode(CHOICE_PROMPT)) // BLOCK_SIZE == 2
        assert len(reference.tokenizer.encode(LONG_PROMPT)) // BLOCK_SIZE == 20
        expected_long, *expected_choices = reference.completions(
            [(LONG_PROMPT, {**GREEDY, "max_tokens": long_tokens})]
            + [(CHOICE_PROMPT, {**seeded, "seed": 77 + i, "max_tokens": choice_tokens})
               for i in range(n)]
        )  # fmt: skip
        decode = cluster.decodes[0]
        assert cluster.gateway is not None
        gateway = cluster.gateway
        shared_before = await cluster.instance_counter(decode, "pdserve_decode_leases_shared")
        # NOTE: a busy machine may let the long stream end before the choices outgrow the
        # pool (none preempted: the choices start when it streams its first token, and the
        # faster its steps, the sooner it ends), and a preempted choice's new lease may take the
        # block choice 0 was to grow into (choice 0, then the newest running request, is
        # preempted too): the round runs again, up to five times, until a later choice alone
        # is.
        for _ in range(5):
            mark = log_mark(cluster)
            streaming = asyncio.Event()
            async with cluster.openai() as client:
                long_task = asyncio.create_task(
                    stream_token_ids(
                        client, cluster.model_name, LONG_PROMPT, max_tokens=long_tokens,
                        on_tokens=set_when_streaming(streaming, 1), **GREEDY,
                    )
                )  # fmt: skip
                await asyncio.wait_for(streaming.wait(), 30)
                choices = await stream_choices(
                    client, cluster.model_name, CHOICE_PROMPT, max_tokens=choice_tokens, n=n,
                    timeout_s=120, **copy.deepcopy(seeded),
                )  # fmt: skip
                long_ids = await long_task
            assert long_ids == expected_long
            assert [ids for ids, _ in choices] == expected_choices

            def choices_logged(mark: dict[str, int] = mark) -> bool:
                # NOTE: the gateway's log is read as it writes it, a moment after the streams end.
                ended = [e["request_id"] for e in events_since(mark, gateway, "request_finished")]
                return sum(1 for i in ended if i.rsplit("-", 1)[-1].isdigit()) >= n

            await eventually(choices_logged, 30, "the choices' request_finished lines")
            finished = {e["request_id"]: e for e in events_since(mark, gateway, "request_finished")}
            (choice_base,) = {i.rsplit("-", 1)[0] for i in finished if i.rsplit("-", 1)[-1] == "3"}
            choice_ids = [f"{choice_base}-{i}" for i in range(n)]
            preempted = {e["request_id"] for e in events_since(mark, decode, "request_preempted")}
            if preempted and choice_ids[0] not in preempted:
                break
        rescheduled = {i for i, e in finished.items() if e["num_reschedules"]}
        # Some later choice was preempted; each preempted choice, and nothing else, was
        # rescheduled.
        assert preempted and preempted <= set(choice_ids[1:]), preempted
        assert rescheduled == preempted
        assert finished[choice_ids[0]]["num_reschedules"] == 0
        # The later choices (and a rescheduled one, beside a sibling) shared the prompt's blocks.
        shared = await cluster.instance_counter(decode, "pdserve_decode_leases_shared")
        assert shared - shared_before >= n - 1


# ---- faults that leave every process running: corrupt KV, a prefill that never sends ---------

LEASE_TTL_MS = 2000


@pytest.fixture(scope="class")
def faulty_prefill_cluster(
    request: pytest.FixtureRequest,
    demo_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ProcessCluster]:
    # NOTE: prefill-1 corrupts the first KV chunk of every request it serves; prefill-0 is
    # healthy. A corrupt transfer is retried as a whole request on another prefill, so the
    # gateway's default of 3 attempts is plenty. The test's prompts share their first block:
    # cache-aware routing would send them all to the prefill that took the first one (half
    # the time never the faulty one), so requests go by load alone.
    with chaos_cluster(
        demo_model_dir,
        tmp_path_factory.mktemp("faulty-prefill-logs"),
        request.param,
        tmp_path_factory,
        prefills=2,
        child_env={"prefill-1": {ENV_FAULT_CORRUPT_KV: "*"}},
        prefill_args=PREFILL_ARGS,
        decode_args=f"{DECODE_ARGS} --lease-ttl-ms {LEASE_TTL_MS}",
        gateway_args="--no-cache-aware-routing",
    ) as (cluster, _):
        yield cluster


@pytest.fixture
async def faulty(faulty_prefill_cluster: ProcessCluster) -> AsyncIterator[ProcessCluster]:
    async with whole_before_and_after(faulty_prefill_cluster):
        yield faulty_prefill_cluster


class TestFaultsThatLeaveEveryProcessRunning:
    """A prefill that corrupts KV beside a healthy one, on a cluster shared per store."""

    @pytest.mark.parametrize("faulty_prefill_cluster", STORES, indirect=True)
    async def test_corrupted_kv_chunk_is_detected_and_retried(
        self, faulty: ProcessCluster, reference: Reference
    ) -> None:
        cluster, max_tokens = faulty, 24
        faulty_prefill, decode = cluster.prefills[1], cluster.decodes[0]
        assert events_named(faulty_prefill, "fault_injection_enabled")
        assert not events_named(cluster.prefills[0], "fault_injection_enabled")
        requests = cases(8, prefix="Checksums matter")
        expected = await expected_ids(reference, requests, max_tokens)
        mark = log_mark(cluster)
        retries = await cluster.counter("pdserve_gateway_retries", reason="CACHE_SYNC_FAILED")
        async with cluster.openai() as client:
            # NOTE: the router spreads concurrent requests over both prefills; a few rounds
            # make sure the faulty one served some.
            for _ in range(5):
                results = await asyncio.gather(
                    *(
                        stream_token_ids(
                            client, cluster.model_name, prompt, max_tokens=max_tokens, **sampling
                        )
                        for prompt, sampling in requests
                    )
                )
                assert results == expected
                if events_since(mark, decode, "cache_sync_failed"):
                    break
        rejected = events_since(mark, decode, "cache_sync_failed")
        assert rejected, "the faulty prefill never served a request"
        assert all(
            "crc" in e["detail"].lower() or "checksum" in e["detail"].lower() for e in rejected
        )
        assert (
            await cluster.counter("pdserve_gateway_retries", reason="CACHE_SYNC_FAILED") > retries
        )
        # Every retry moved to the healthy prefill: no request needed a third attempt.
        assert cluster.gateway is not None
        finished = events_since(mark, cluster.gateway, "request_finished")
        assert finished and max(e["num_attempts"] for e in finished) <= 2

    @pytest.mark.parametrize("faulty_prefill_cluster", ["off"], indirect=True)
    async def test_lease_of_a_prefill_that_never_sends_expires(
        self, faulty: ProcessCluster
    ) -> None:
        cluster = faulty
        decode = cluster.decodes[0]
        status = await cluster.pool_status(address(decode))
        request_id = f"silent-prefill-{os.getpid()}"
        channel = cluster.security("prefill-0").channel(address(decode), role_dns_name("decode"))
        try:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            response = await stub.AllocateBlocks(
                decode_pb2.AllocateBlocksRequest(
                    request_id=request_id,
                    num_prompt_tokens=100,
                    max_new_tokens=16,
                    kv_layout=status.instance.kv_layout,
                    protocol=local_protocol(),
                    prefill_instance_id="silent-prefill",
                ),
                timeout=5,
            )
            lease = response.lease
            granted_at = time.monotonic()
            assert len(lease.block_ids) >= 7 and lease.ttl_ms == LEASE_TTL_MS
            held = (await cluster.pool_status(address(decode))).pool
            assert held.num_open_leases >= 1 and held.num_leased_blocks >= len(lease.block_ids)

            # Nothing is ever sent: the decode reclaims the blocks on its own after the TTL.
            await cluster.wait_whole(timeout_s=LEASE_TTL_MS / 1000 + 5)
            assert time.monotonic() - granted_at >= LEASE_TTL_MS / 1000 * 0.9
            expired = [
                e for e in events_named(decode, "lease_expired") if e["lease_id"] == lease.lease_id
            ]
            assert expired, "the decode did not log the lease's expiry"

            # A prefill that wakes up late is refused with a typed error, never decoded from.
            def late_transfer() -> Iterator[decode_pb2.SyncCacheRequest]:
                header = decode_pb2.SyncCacheHeader(
                    lease_id=lease.lease_id, request_id=request_id, token_ids=[5] * 100
                )
                yield decode_pb2.SyncCacheRequest(header=header)

            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.SyncCache(late_transfer(), timeout=5)
            reason = from_rpc_error(refused.value).reason
            assert reason in (ErrorReason.LEASE_EXPIRED, ErrorReason.LEASE_NOT_FOUND)
            released = await stub.ReleaseLease(
                decode_pb2.ReleaseLeaseRequest(lease_id=lease.lease_id, request_id=request_id),
                timeout=5,
            )
            assert released.state == decode_pb2.LEASE_STATE_EXPIRED
        finally:
            await channel.close()


# ---- bounded load: 64 streaming clients ------------------------------------------------------

NUM_CLIENTS = 64
NUM_REQUESTS_PER_CLIENT = 3


@pytest.mark.slow
async def test_load_64_streaming_clients(demo_model_dir: Path, tmp_path: Path) -> None:
    # NOTE: the fast numerics, as `pdserve up` runs: no stream moves here, and float32
    # requests beside others give the tokens they give alone.
    reference = Reference(demo_model_dir)
    load_cases = [
        (prompt, sampling, 8 + 4 * (i % 7))
        for i, (prompt, sampling) in enumerate(cases(16, "Load"))
    ]
    expected = await asyncio.to_thread(
        lambda: [reference.completion(p, max_tokens=n, **s) for p, s, n in load_cases]
    )
    errors: list[str] = []
    mismatches: list[int] = []
    num_done = [0] * NUM_CLIENTS

    async def client_loop(
        cluster: ProcessCluster, client: openai.AsyncOpenAI, client_index: int
    ) -> None:
        for turn in range(client_index, client_index + NUM_REQUESTS_PER_CLIENT):
            case = turn % len(load_cases)
            prompt, sampling, max_tokens = load_cases[case]
            try:
                ids = await stream_token_ids(
                    client, cluster.model_name, prompt, max_tokens=max_tokens, **sampling
                )
            except (openai.OpenAIError, TimeoutError) as error:
                errors.append(f"client {client_index}: {error!r}")
                continue
            if ids != expected[case]:
                mismatches.append(case)
            num_done[client_index] += 1

    # what `pdserve up` runs
    with running_cluster(demo_model_dir, tmp_path) as cluster:
        async with cluster.openai() as client:
            await asyncio.gather(*(client_loop(cluster, client, i) for i in range(NUM_CLIENTS)))

        assert errors == []
        assert mismatches == []
        assert num_done == [NUM_REQUESTS_PER_CLIENT] * NUM_CLIENTS
        finished = await cluster.counter("pdserve_gateway_requests", outcome="finished")
        assert finished == sum(num_done)
        await cluster.wait_whole()
