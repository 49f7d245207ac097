"""Background responses and streams that outlive their gateway: two gateway processes on one
etcd, real prefill and decode processes, the openai SDK as the client.

A background response created on one gateway is read, streamed from a sequence number and
cancelled through the other; only the key that created it sees it. A stored response is read
and continued by ``previous_response_id`` through the other. Then the gateway holding 8
live streams is killed (SIGKILL): each client resumes through the other gateway from the last
event it got, receives every remaining event exactly once, and ends with the text an
undisturbed run of the same request gives; the background responses nobody streams are
adopted by the other gateway once the dead one's key lapsed, and complete equal too; no block
or lease is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from support.eventually import eventually
from support.process_cluster import ProcessCluster, events_named, running_cluster_on_etcd
from support.resumable_sse import chat_content, left_after, sse_events

from pdserve.common.grpc_server import insecure_channel
from pdserve.launcher.child import ChildProcess
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

INSTANCE_ARGS = "--num-blocks 512 --registry-ttl-s 2 --heartbeat-interval-s 0.3"
KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-2"}
PROMPT = "Tell me about serving systems"


@contextlib.contextmanager
def two_gateways(demo_model_dir: Path, tmp_path: Path) -> Iterator[ProcessCluster]:
    """Two gateways over one prefill and one decode, shared through a real etcd."""
    key_file = tmp_path / "keys"
    key_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    gateway_args = (
        f"--instance-ttl-s 3 --heartbeat-interval-s 0.3 --api-key-file {key_file} "
        "--resume-holder-ttl-s 2"
    )
    with running_cluster_on_etcd(
        demo_model_dir,
        tmp_path,
        gateways=2,
        prefill_args=INSTANCE_ARGS,
        decode_args=INSTANCE_ARGS,
        gateway_args=gateway_args,
    ) as (started, _):
        yield started


@pytest.fixture(scope="module")
def cluster(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessCluster]:
    """Shared by the cases that leave every process running (each finds every pool whole)."""
    with two_gateways(demo_model_dir, tmp_path_factory.mktemp("two-gateways")) as started:
        yield started


@pytest.fixture
def own_cluster(demo_model_dir: Path, tmp_path: Path) -> Iterator[ProcessCluster]:
    """For a case that kills a gateway."""
    with two_gateways(demo_model_dir, tmp_path) as started:
        yield started


def _client(cluster: ProcessCluster, gateway: int, key: str = "alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{cluster.rest_urls[gateway]}/v1", api_key=KEYS[key], max_retries=0, timeout=60
    )


def _body(cluster: ProcessCluster, seed: int, max_output_tokens: int) -> dict[str, Any]:
    return {
        "model": cluster.model_name,
        "input": PROMPT,
        "max_output_tokens": max_output_tokens,
        "temperature": 0.8,
        "extra_body": {"seed": seed, "ignore_eos": True},
    }


async def _ready(cluster: ProcessCluster) -> None:
    async def both_serve() -> bool:
        for gateway in range(2):
            try:
                models = await _client(cluster, gateway).models.list()
            except openai.APIError:
                return False
            if not models.data:
                return False
        return True

    await eventually(both_serve, 30, "both gateways serve the model")


async def test_background_responses_through_either_gateway(cluster: ProcessCluster) -> None:
    await _ready(cluster)
    first, other = _client(cluster, 0), _client(cluster, 1)
    body = _body(cluster, seed=7, max_output_tokens=24)
    undisturbed = await first.responses.create(**body)

    created = await first.responses.create(**body, background=True)
    assert created.status in ("queued", "in_progress")
    assert created.background is True

    async def done() -> bool:
        got = await other.responses.retrieve(created.id)
        return got.status == undisturbed.status

    # NOTE: it ends by max_output_tokens (ignore_eos): "incomplete", as OpenAI says it.
    assert undisturbed.status == "incomplete"
    await eventually(done, 30, "the background response ended")
    retrieved = await other.responses.retrieve(created.id)
    assert retrieved.output_text == undisturbed.output_text
    assert retrieved.usage is not None and retrieved.usage.output_tokens == 24

    # NOTE: the whole stream again from the other gateway, then from sequence number 3 on.
    whole = [event async for event in await other.responses.retrieve(created.id, stream=True)]
    numbers = [event.sequence_number for event in whole]
    assert numbers == list(range(len(whole)))
    assert whole[-1].type == "response.incomplete"
    deltas = "".join(e.delta for e in whole if e.type == "response.output_text.delta")
    assert deltas == undisturbed.output_text
    tail = await first.responses.retrieve(created.id, stream=True, starting_after=3)
    resumed = [event async for event in tail]
    assert [e.model_dump() for e in resumed] == [e.model_dump() for e in whole[4:]]
    # NOTE: past the end: the end.
    past = await other.responses.retrieve(created.id, stream=True, starting_after=10_000)
    assert [event.type async for event in past] == ["response.incomplete"]

    # NOTE: to another key, and for ids nobody made, there is no such response.
    stranger = _client(cluster, 1, "bob")
    for call in (
        stranger.responses.retrieve(created.id),
        stranger.responses.cancel(created.id),
        stranger.responses.delete(created.id),
        other.responses.retrieve("resp_0123456789abcdef"),
        other.responses.retrieve("not-a-response"),
    ):
        with pytest.raises(openai.NotFoundError):
            await call

    # NOTE: a long response cancelled through the gateway that does not hold it.
    long = await first.responses.create(**_body(cluster, 8, 2000), background=True)
    await eventually(
        lambda: _has_output(other, long.id), 30, "the long response produced some output"
    )
    cancelled = await other.responses.cancel(long.id)
    assert cancelled.status == "cancelled"

    async def cancelled_on_the_holder() -> bool:
        # NOTE: the holder learns it when its decode stream ends, a moment later.
        return (await first.responses.retrieve(long.id)).status == "cancelled"

    await eventually(cancelled_on_the_holder, 30, "the holding gateway says cancelled")
    await cluster.wait_whole(15)

    await other.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        await first.responses.retrieve(created.id)


async def test_a_stored_response_is_continued_through_the_other_gateway(
    cluster: ProcessCluster,
) -> None:
    await _ready(cluster)
    first, other = _client(cluster, 0), _client(cluster, 1)
    body = _body(cluster, seed=11, max_output_tokens=8)
    asked = await first.responses.create(**body)
    assert (await other.responses.retrieve(asked.id)).model_dump() == asked.model_dump()
    follow_up = {**body, "input": "And then?"}
    continued = await other.responses.create(**follow_up, previous_response_id=asked.id)
    whole = [
        {"role": "user", "content": PROMPT},
        *[item.model_dump(exclude_none=True) for item in asked.output],
        {"role": "user", "content": "And then?"},
    ]
    sent_whole = await first.responses.create(**{**follow_up, "input": whole}, store=False)
    assert continued.output_text == sent_whole.output_text
    assert continued.usage is not None and sent_whole.usage is not None
    assert continued.usage.input_tokens == sent_whole.usage.input_tokens
    # NOTE: another key cannot continue it: to that key it does not exist.
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        await _client(cluster, 1, "bob").responses.create(
            **follow_up, previous_response_id=asked.id
        )
    await cluster.wait_whole(15)


async def _has_output(client: openai.AsyncOpenAI, response_id: str) -> bool:
    got = await client.responses.retrieve(response_id)
    return bool(got.output_text)


NUM_STREAMS = 8
NUM_KEPT = 2
NUM_TOKENS = 600  # NOTE: long enough to be mid-stream on a slow machine when the kill lands


async def test_streams_outlive_a_killed_gateway(own_cluster: ProcessCluster) -> None:
    cluster = own_cluster
    await _ready(cluster)
    holder, other = _client(cluster, 0), _client(cluster, 1)
    bodies = [
        _body(cluster, seed=100 + i, max_output_tokens=NUM_TOKENS) for i in range(NUM_STREAMS)
    ]
    streams = [await holder.responses.create(**b, background=True, stream=True) for b in bodies]
    # NOTE: and responses no client follows: read only as snapshots, never streamed.
    kept_bodies = [
        _body(cluster, seed=200 + i, max_output_tokens=NUM_TOKENS) for i in range(NUM_KEPT)
    ]
    kept = [await holder.responses.create(**b, background=True) for b in kept_bodies]
    before: list[list[Any]] = [[] for _ in streams]

    async def read_some(index: int) -> None:
        async for event in streams[index]:
            before[index].append(event)
            deltas = [e for e in before[index] if e.type == "response.output_text.delta"]
            if len(deltas) >= 4:
                return

    await asyncio.wait_for(asyncio.gather(*(read_some(i) for i in range(NUM_STREAMS))), 60)
    gateway = cluster.gateways[0]
    gateway.signal(signal.SIGKILL)
    assert gateway.wait(10) == -signal.SIGKILL

    async def resume(index: int) -> list[Any]:
        response_id = before[index][0].response.id
        last = before[index][-1].sequence_number
        resumed = await other.responses.retrieve(response_id, stream=True, starting_after=last)
        return [event async for event in resumed]

    after = await asyncio.wait_for(asyncio.gather(*(resume(i) for i in range(NUM_STREAMS))), 120)
    undisturbed = await asyncio.gather(*(other.responses.create(**b) for b in bodies))
    for index in range(NUM_STREAMS):
        events = before[index] + after[index]
        assert [e.sequence_number for e in events] == list(range(len(events))), index
        assert events[-1].type == "response.incomplete", index
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == events[-1].response.output_text == undisturbed[index].output_text, index
        assert events[-1].response.usage.output_tokens == NUM_TOKENS
    # NOTE: gateway 1 takes each stream over from its decode, unless gateway 0 had every token
    # and stored the end before the kill (the clients read behind it on a busy machine): that
    # one is replayed from the store. Its log lines reach this process a moment late.
    ids = [before[i][0].response.id.removeprefix("resp_") for i in range(NUM_STREAMS)]

    def resumed_how() -> dict[str, str]:
        resumed = events_named(cluster.gateways[1], "resumable_request_resumed")
        return {e["request_id"]: e["how"] for e in resumed if e["request_id"] in ids}

    await eventually(lambda: len(resumed_how()) == NUM_STREAMS, 30, "every resume logged")
    hows = resumed_how()
    ended = {e["request_id"] for e in events_named(gateway, "request_finished")}
    assert all(hows[i] == "takeover" or (hows[i] == "stored" and i in ended) for i in ids), hows
    assert "takeover" in hows.values(), "gateway 0 had ended every stream before the kill"

    async def kept_ended() -> bool:
        got = [await other.responses.retrieve(k.id) for k in kept]
        return all(g.status != "in_progress" and g.status != "queued" for g in got)

    await eventually(kept_ended, 120, "the dead gateway's background responses ended")
    got = [await other.responses.retrieve(k.id) for k in kept]
    undisturbed_kept = await asyncio.gather(*(other.responses.create(**b) for b in kept_bodies))
    assert [g.status for g in got] == ["incomplete"] * NUM_KEPT, [g.error for g in got]
    assert [g.output_text for g in got] == [u.output_text for u in undisturbed_kept]
    adopted = {
        e["request_id"] for e in events_named(cluster.gateways[1], "resumable_request_adopted")
    }
    assert {k.id.removeprefix("resp_") for k in kept} <= adopted
    await cluster.wait_whole(15)


NUM_CHAT_TOKENS = 400


async def test_a_resumable_chat_stream_resumes_on_the_other_gateway(
    cluster: ProcessCluster,
) -> None:
    """The client leaves gateway 0 mid-stream (gateway 0 runs on) and resumes through gateway
    1, which takes the stream over from the decode: gateway 0 lets go without releasing the
    lease, and nothing runs twice."""
    await _ready(cluster)
    body = {
        "model": cluster.model_name,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": NUM_CHAT_TOKENS,
        "temperature": 0.8,
        "seed": 11,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    holder, taker = cluster.gateways
    async with httpx.AsyncClient(timeout=60, headers=headers) as http:
        other = cluster.rest_urls[1]
        whole = await http.post(f"{other}/v1/chat/completions", json=body)
        undisturbed = chat_content(sse_events(whole.text))
        # NOTE: on a busy machine gateway 0 may get all 400 tokens from the decode before the
        # resume reaches gateway 1 (then there is nothing to take over: it goes again, at most
        # 3 times); each try must end equal to the undisturbed run either way.
        for _ in range(3):
            stream_id, last_id, after = await _leave_and_resume(http, cluster, body, undisturbed)
            ending = await asyncio.to_thread(_holder_ending, holder, stream_id)
            if ending == "resumable_request_moved":
                break
        assert ending == "resumable_request_moved", "gateway 0 ended each stream before a resume"
        resumed = events_named(taker, "resumable_request_resumed")
        assert [e["how"] for e in resumed if e["request_id"] == stream_id] == ["takeover"]
        moved = [e["request_id"] for e in events_named(holder, "resumable_request_moved")]
        assert moved.count(stream_id) == 1, "gateway 0 was still running it when taken over"
        elsewhere = events_named(taker, "resume_continues_elsewhere")
        assert not [e for e in elsewhere if e["request_id"] == stream_id]
        released = events_named(cluster.decodes[0], "lease_released")
        assert not [e for e in released if e["request_id"] == stream_id]
        # NOTE: by the Last-Event-ID header too, and not for another key.
        url = f"{other}/v1/chat/completions/chatcmpl-{stream_id}/stream"
        again = await http.get(url, headers={"Last-Event-ID": str(last_id)})
        assert sse_events(again.text) == after
        stranger = await http.get(url, headers={"Authorization": f"Bearer {KEYS['bob']}"})
        assert stranger.status_code == 404
    await cluster.wait_whole(15)


async def _leave_and_resume(
    http: httpx.AsyncClient, cluster: ProcessCluster, body: dict[str, Any], undisturbed: str
) -> tuple[str, int, list[tuple[int, Any]]]:
    """Streams `body` resumably from gateway 0, leaves after 6 events and resumes the rest
    through gateway 1; checks the whole is `undisturbed`. Returns the stream's id, the last
    event id read from gateway 0 and the events read from gateway 1."""
    first, other = cluster.rest_urls
    resumable = {**body, "stream_options": {"resumable": True, "include_usage": True}}
    stream_id, before = await left_after(http, f"{first}/v1/chat/completions", resumable)
    last_id = before[-1][0]
    assert 0 < last_id < NUM_CHAT_TOKENS
    url = f"{other}/v1/chat/completions/chatcmpl-{stream_id}/stream"
    resumed = await http.get(url, params={"starting_after": last_id})
    assert resumed.status_code == 200, resumed.text
    after = sse_events(resumed.text)
    assert all(event_id > last_id for event_id, _ in after[:1])
    assert after[-1][1] == "[DONE]"
    usage = [d["usage"] for _, d in after if isinstance(d, dict) and d.get("usage")]
    assert usage[-1]["completion_tokens"] == NUM_CHAT_TOKENS
    assert chat_content(before) + chat_content(after) == undisturbed
    return stream_id, last_id, after


def _holder_ending(holder: ChildProcess, request_id: str) -> str:
    """How gateway 0's run of `request_id` ended: ``resumable_request_moved`` (taken over
    while it ran) or ``request_finished`` (it had every token before the takeover); waits for
    one of them (gateway 0 hears of a takeover on its own stream from the decode, which may
    reach it after gateway 1 has finished streaming on a busy machine)."""
    endings = ("resumable_request_moved", "request_finished")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for record in list(holder.events):
            if record.get("event") in endings and record.get("request_id") == request_id:
                return str(record["event"])
        time.sleep(0.05)
    raise AssertionError(f"gateway 0 logged none of {endings} for {request_id} in 30 s")


async def test_a_resumable_grpc_call_resumes_on_the_other_gateway(cluster: ProcessCluster) -> None:
    await _ready(cluster)
    metadata = (("authorization", f"Bearer {KEYS['alice']}"),)
    sampling = common_pb2.SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)
    request = generation_pb2.GenerateRequest(
        model=cluster.model_name, text=PROMPT, sampling=sampling, resumable=True
    )
    first, other = cluster.grpc_addresses
    async with insecure_channel(first) as channel, insecure_channel(other) as other_channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        other_stub = generation_pb2_grpc.GenerationServiceStub(other_channel)
        plain = generation_pb2.GenerateRequest()
        plain.CopyFrom(request)
        plain.resumable = False
        undisturbed = [m async for m in other_stub.Generate(plain, metadata=metadata)]
        before = []
        call = stub.Generate(request, metadata=metadata)
        async for message in call:
            before.append(message)
            if len(before) == 5:
                call.cancel()  # NOTE: the client goes away; the request runs on
                break
        request_id = before[0].request_id
        num_tokens = sum(len(m.token_ids) for m in before)
        resume = generation_pb2.ResumeRequest(request_id=request_id, from_index=num_tokens)
        after = [m.response async for m in other_stub.Resume(resume, metadata=metadata)]
        tokens = [t for m in before + after for t in m.token_ids]
        assert tokens == [t for m in undisturbed for t in m.token_ids]
        assert "".join(m.text for m in before + after) == "".join(m.text for m in undisturbed)
        assert after[0].first_index == num_tokens
        assert after[-1].usage.num_completion_tokens == 40
        # NOTE: past the end, the end; another key's request does not exist.
        past = generation_pb2.ResumeRequest(request_id=request_id, from_index=1000)
        ends = [m.response async for m in other_stub.Resume(past, metadata=metadata)]
        assert len(ends) == 1 and ends[0].usage.num_completion_tokens == 40
        bob = (("authorization", f"Bearer {KEYS['bob']}"),)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            async for _ in other_stub.Resume(resume, metadata=bob):
                pass
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    await cluster.wait_whole(15)
