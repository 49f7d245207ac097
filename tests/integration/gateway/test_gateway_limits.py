"""Request limits: body and message sizes (413), prompt and list sizes (400), concurrency (429),
the chat max_tokens default, the preparation budget (504), and instances that stay alive while
the gateway's event loop is stalled."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from support.eventually import eventually
from support.gateway_cluster import Cluster
from support.gateway_fakes import MAX_MODEL_LEN, MODEL_NAME, heartbeat

from pdserve.common.errors import ErrorReason, from_rpc_error, has_error_info
from pdserve.common.grpc_server import insecure_channel
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.fleet.liveness import LivenessClock
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


async def _answer_head(port: int, request_head: bytes, timeout_s: float = 30.0) -> bytes:
    """Sends raw HTTP/1.1 request headers (and nothing after them) and returns the response's
    status line and headers, which must arrive within `timeout_s` (a bound for a hung server,
    not a speed the machine must reach)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_head)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
    finally:
        writer.close()


async def test_declared_oversized_body_is_413_before_it_is_sent(pd: Cluster) -> None:
    gateway = pd.gateway
    assert gateway is not None and gateway.http_port is not None
    # NOTE: only the headers go out, never the 10 MB they declare: an answer at all is the
    # server answering without waiting for the body (a server that waited would never answer).
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10000000\r\n\r\n"
    )
    answer = await _answer_head(gateway.http_port, head)
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert pd.prefills[0].requests == []


async def test_chunked_body_growing_past_the_limit_is_413(cluster: Cluster) -> None:
    await cluster.start_gateway(max_body_bytes=1000)
    prefill = await cluster.add_prefill()
    await cluster.add_decode()

    async def chunks() -> Any:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'

    async with cluster.http() as http:
        response = await http.post(
            COMPLETIONS, content=chunks(), headers={"content-type": "application/json"}
        )
        assert response.status_code == 413
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("request_too_large", "body")
        # the same client (and its pooled connection) goes on working
        ok = await http.post(
            COMPLETIONS, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
        )
        assert ok.status_code == 200
    assert len(prefill.requests) == 1


async def test_10mb_body_is_refused_at_once_while_other_requests_and_heartbeats_go_on(
    cluster: Cluster,
) -> None:
    await cluster.start_gateway(instance_ttl_s=1.0, heartbeat_interval_s=0.2)
    prefill = await cluster.add_prefill()
    decode = await cluster.add_decode()
    gateway = cluster.gateway
    assert gateway is not None
    stop = asyncio.Event()

    async def heartbeats() -> None:
        while not stop.is_set():
            for instance in (prefill, decode):
                await heartbeat(cluster.internal_address, instance)
            await asyncio.sleep(0.2)

    beating = asyncio.create_task(heartbeats())
    body = b'{"model": "tiny", "prompt": "' + b"x" * 10_000_000 + b'"}'
    async with cluster.http() as http:
        # No wall-clock bound (it raced a busy machine): the 413 before the body is read is
        # `test_declared_oversized_body_is_413_before_it_is_sent`'s; here the proof is that the
        # other request is served and no instance's 1 s TTL lapses while the body arrives.
        big, normal = await asyncio.gather(
            http.post(COMPLETIONS, content=body, headers={"content-type": "application/json"}),
            http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3}),
        )
    stop.set()
    await beating
    assert big.status_code == 413
    assert big.json()["error"]["code"] == "request_too_large"
    assert normal.status_code == 200
    assert {e.instance_id for e in gateway.registry.alive()} == {"prefill-0", "decode-0"}
    assert gateway.metrics.count("instances_lost", "prefill") == 0
    assert gateway.metrics.count("instances_lost", "decode") == 0


async def test_grpc_message_over_the_receive_limit_is_resource_exhausted(cluster: Cluster) -> None:
    await cluster.start_gateway(grpc_max_receive_bytes=4096)
    await cluster.add_prefill()
    await cluster.add_decode()
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME, text="x" * 10_000, sampling=common_pb2.SamplingParams(max_tokens=2)
    )
    async with insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [r async for r in stub.Generate(request)]
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        request.text = "x"
        responses = [r async for r in stub.Generate(request)]
    assert responses[-1].usage.num_completion_tokens == 2


SMALL_LIMITS = {
    "max_prompt_chars": 50,
    "max_prompt_tokens": 40,
    "max_messages": 3,
    "max_stop_strings": 2,
    "max_stop_chars": 5,
    "max_stop_token_ids": 2,
    "max_tokens_limit": 20,
}
USER = {"role": "user", "content": "hi"}
# (name, REST path, REST fields, gRPC fields, reason, param); both front ends send the same.
LIMIT_CASES: list[tuple[str, str, dict[str, Any], dict[str, Any], str, str]] = [
    ("prompt_chars", COMPLETIONS, {"prompt": "x" * 51}, {"text": "x" * 51},
     "invalid_request", "prompt"),
    ("chat_chars", CHAT, {"messages": [{"role": "user", "content": "x" * 30}] * 2},
     {"chat": [("user", "x" * 30)] * 2}, "invalid_request", "messages"),
    ("prompt_tokens", COMPLETIONS, {"prompt": [65] * 41}, {"token_ids": [65] * 41},
     "prompt_too_long", "prompt"),
    ("chat_tokens", CHAT, {"messages": [{"role": "user", "content": "x" * 45}]},
     {"chat": [("user", "x" * 45)]}, "prompt_too_long", "messages"),
    ("messages", CHAT, {"messages": [USER] * 4}, {"chat": [("user", "hi")] * 4},
     "invalid_request", "messages"),
    ("stop_strings", COMPLETIONS, {"prompt": "x", "stop": ["a", "b", "c"]},
     {"text": "x", "stop": ["a", "b", "c"]}, "invalid_request", "stop"),
    ("stop_chars", COMPLETIONS, {"prompt": "x", "stop": ["abcdef"]},
     {"text": "x", "stop": ["abcdef"]}, "invalid_request", "stop"),
    ("stop_token_ids", COMPLETIONS, {"prompt": "x", "stop_token_ids": [1, 2, 3]},
     {"text": "x", "stop_token_ids": [1, 2, 3]}, "invalid_request", "stop_token_ids"),
    ("max_tokens", COMPLETIONS, {"prompt": "x", "max_tokens": 21},
     {"text": "x", "max_tokens": 21}, "invalid_request", "max_tokens"),
    ("top_k_2_32", COMPLETIONS, {"prompt": "x", "top_k": 2**32}, {"text": "x"},
     "invalid_request", "top_k"),
    ("developer_ok_tool_needs_its_call", CHAT,
     {"messages": [{"role": "developer", "content": "be brief"}, {"role": "tool", "content": "x"}]},
     {"chat": [("developer", "be brief"), ("tool", "x")]}, "invalid_request",
     "messages[1].tool_call_id"),
    ("unknown_role", CHAT, {"messages": [{"role": "robot", "content": "x"}]},
     {"chat": [("robot", "x")]}, "invalid_request", "messages[0].role"),
]  # fmt: skip


def _grpc_request(fields: dict[str, Any]) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        max_tokens=fields.get("max_tokens", 2), stop_token_ids=fields.get("stop_token_ids", ())
    )
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME, sampling=sampling, stop=fields.get("stop", ())
    )
    if "text" in fields:
        request.text = fields["text"]
    elif "token_ids" in fields:
        request.token_ids.token_ids.extend(fields["token_ids"])
    else:
        for role, content in fields["chat"]:
            request.chat.messages.add(role=role, content=content)
    return request


@pytest.mark.parametrize(
    ("name", "path", "rest", "rpc", "code", "param"), LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES]
)
async def test_limits_are_the_same_400_over_rest_and_grpc(
    cluster: Cluster,
    name: str,
    path: str,
    rest: dict[str, Any],
    rpc: dict[str, Any],
    code: str,
    param: str,
) -> None:
    await cluster.start_gateway(**SMALL_LIMITS)
    prefill = await cluster.add_prefill()
    await cluster.add_decode()
    async with cluster.http() as http:
        response = await http.post(path, json={"model": MODEL_NAME, **rest})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    if name == "top_k_2_32":
        return  # a uint32 on the wire: gRPC cannot even say it
    async with insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [r async for r in stub.Generate(_grpc_request(rpc))]
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert has_error_info(raised.value)
    rpc_error = from_rpc_error(raised.value)
    assert (rpc_error.reason.name.lower(), rpc_error.metadata.get("param")) == (code, param)
    assert prefill.requests == []


async def test_developer_role_is_system_over_rest_and_grpc(pd: Cluster) -> None:
    messages = [{"role": "developer", "content": "be brief"}, USER]
    async with pd.http() as http:
        response = await http.post(
            CHAT, json={"model": MODEL_NAME, "messages": messages, "max_tokens": 2}
        )
    assert response.status_code == 200, response.text
    async with insecure_channel(pd.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        request = _grpc_request({"chat": [("developer", "be brief"), ("user", "hi")]})
        responses = [r async for r in stub.Generate(request)]
    assert responses[-1].usage.num_completion_tokens == 2
    # <|system|> = 257 in the fake tokenizer: "developer" was rendered as "system"
    assert [list(r.token_ids[:1]) for r in pd.prefills[0].requests] == [[257], [257]]


async def _hold_streams(cluster: Cluster, keys: list[str]) -> list[Any]:
    """Opens one streamed completion per key; each stays open until the prefill is released."""
    streams = []
    for key in keys:
        client = cluster.openai(key)
        streams.append(
            await client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, stream=True)
        )
    return streams


async def test_concurrent_requests_per_key_and_in_total_get_429(cluster: Cluster) -> None:
    gateway = await cluster.start_gateway(
        max_concurrent_requests=2, max_concurrent_requests_per_key=1
    )
    prefill = await cluster.add_prefill()
    await cluster.add_decode()
    prefill.knobs.hold_before_handoff = True
    streams = await _hold_streams(cluster, ["key-a", "key-b"])
    assert gateway.limiter.num_in_flight == 2
    async with cluster.http() as http:
        for key, kind in (("key-a", "API key"), ("key-c", "gateway")):
            response = await http.post(
                COMPLETIONS,
                json={"model": MODEL_NAME, "prompt": "x"},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert response.status_code == 429
            assert response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert (error["code"], error["type"]) == ("rate_limited", "rate_limit_error")
            assert kind in error["message"]
    async with insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [r async for r in stub.Generate(_grpc_request({"text": "x"}))]
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    rpc_error = from_rpc_error(raised.value)
    assert rpc_error.reason is ErrorReason.RATE_LIMITED
    assert rpc_error.retry_delay_s == pytest.approx(1.0)
    assert len(prefill.requests) == 2  # the refused requests never reached an instance

    prefill.knobs.hold_before_handoff = False
    for stream in streams:
        assert [c async for c in stream][-1].choices[0].finish_reason == "length"
    await eventually(lambda: gateway.limiter.num_in_flight == 0)
    ok = await cluster.openai("key-a").completions.create(
        model=MODEL_NAME, prompt="x", max_tokens=2
    )
    assert ok.usage is not None and ok.usage.completion_tokens == 2


async def test_cancelled_and_failed_requests_give_their_admission_back(pd: Cluster) -> None:
    gateway = pd.gateway
    assert gateway is not None
    pd.prefills[0].knobs.hold_before_handoff = True
    async with pd.http() as http:
        pending = asyncio.create_task(
            http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2})
        )
        await eventually(lambda: len(pd.prefills[0].requests) == 1)
        assert gateway.limiter.num_in_flight == 1
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        bad = await http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": ""})
        assert bad.status_code == 400
    await eventually(lambda: gateway.limiter.num_in_flight == 0)


@pytest.mark.parametrize(("default", "expected"), [(7, 7), (1024, MAX_MODEL_LEN - 4)])
async def test_chat_without_max_tokens_gets_the_capped_default(
    cluster: Cluster, default: int, expected: int
) -> None:
    await cluster.start_gateway(default_chat_max_tokens=default)
    await cluster.add_prefill()
    await cluster.add_decode()
    result = await cluster.openai().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}]
    )
    # the prompt is <|user|>hi<|assistant|>: 4 tokens; the rest of the model's length fits
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (4, expected)


async def test_chat_n_without_max_tokens_gets_what_lets_the_choices_fit_together(
    cluster: Cluster,
) -> None:
    await cluster.start_gateway(default_chat_max_tokens=1024)
    await cluster.add_prefill()
    await cluster.add_decode(num_total_blocks=40)
    result = await cluster.openai().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=4
    )
    # 4 prompt tokens (no full block) and 10 blocks of 4 tokens per choice: 36 tokens each
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (4, 4 * 36)


async def test_preparation_past_its_budget_is_504(cluster: Cluster) -> None:
    await cluster.start_gateway(prepare_timeout_s=0.001)
    prefill = await cluster.add_prefill()
    await cluster.add_decode()
    async with cluster.http() as http:
        response = await http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": "x" * 200_000})
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert prefill.requests == []


async def test_short_prompts_tokenize_without_the_workers_budget(cluster: Cluster) -> None:
    # NOTE: a short prompt tokenizes on the event loop, so even a budget no worker can meet
    # leaves it alone; a long one still goes to the workers and gets the 504.
    await cluster.start_gateway(prepare_timeout_s=0.000_001)
    await cluster.add_prefill()
    await cluster.add_decode()
    async with cluster.http() as http:
        short = await http.post(
            COMPLETIONS, json={"model": MODEL_NAME, "prompt": "x" * 64, "max_tokens": 2}
        )
        long = await http.post(
            COMPLETIONS, json={"model": MODEL_NAME, "prompt": "x" * 200_000, "max_tokens": 2}
        )
    assert short.status_code == 200
    assert short.json()["usage"]["completion_tokens"] == 2
    assert long.status_code == 504


@pytest.mark.parametrize(
    "setting",
    [
        {"max_body_bytes": 0},
        {"grpc_max_receive_bytes": 0},
        {"max_prompt_chars": 0},
        {"max_messages": 0},
        {"max_tokens_limit": -1},
        {"max_concurrent_requests_per_key": 0},
        {"prepare_workers": 0},
        {"parse_processes": 0},
        {"prepare_timeout_s": 0},
        {"default_chat_max_tokens": 0},
    ],
    ids=lambda s: next(iter(s)),
)
def test_bad_limit_settings_are_refused(setting: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(setting))):
        GatewayConfig(insecure=True, **setting)


def test_liveness_clock_stands_still_while_the_loop_is_stalled() -> None:
    now = [0.0]
    clock = LivenessClock(tick_s=0.1, clock=lambda: now[0])
    now[0] = 0.1
    clock.tick()
    now[0] = 0.15
    assert clock() == pytest.approx(0.15)
    now[0] = 5.0  # no tick for 4.9 s: the loop was stalled
    assert clock() == pytest.approx(0.3)  # stopped two ticks after the last one
    assert clock.tick() == pytest.approx(4.7)
    assert clock() == pytest.approx(0.3)  # resumes where it stopped
    now[0] = 5.1
    clock.tick()
    assert clock() == pytest.approx(0.4)
    assert clock.stalled_s == pytest.approx(4.7)


async def test_a_stalled_event_loop_does_not_make_instances_look_dead(cluster: Cluster) -> None:
    gateway = await cluster.start_gateway(instance_ttl_s=1.0, heartbeat_interval_s=0.2)
    prefill = await cluster.add_prefill()
    decode = await cluster.add_decode()
    stop = asyncio.Event()

    async def heartbeats() -> None:
        while not stop.is_set():
            for instance in (prefill, decode):
                await heartbeat(cluster.internal_address, instance)
            await asyncio.sleep(0.1)

    sweeps: list[float] = []
    drop_expired = gateway.registry.drop_expired

    def counted_drop_expired() -> list[str]:
        sweeps.append(time.monotonic())
        return drop_expired()

    gateway.registry.drop_expired = counted_drop_expired  # type: ignore[method-assign]
    beating = asyncio.create_task(heartbeats())
    await eventually(lambda: all(e.load_seq > 0 for e in gateway.registry.entries()))
    seqs = {e.instance_id: e.load_seq for e in gateway.registry.entries()}
    stalled_at = time.monotonic()
    time.sleep(2.0)  # a request path that blocks the loop for twice the TTL
    # the sweep runs and queued heartbeats arrive
    await eventually(lambda: any(swept > stalled_at for swept in sweeps), what="a sweep")
    await eventually(
        lambda: all(e.load_seq > seqs[e.instance_id] for e in gateway.registry.entries())
    )
    stop.set()
    await beating
    assert {e.instance_id for e in gateway.registry.alive()} == {"prefill-0", "decode-0"}
    assert gateway.metrics.count("instances_lost", "decode") == 0
    result = await cluster.openai().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert result.usage is not None and result.usage.completion_tokens == 2


async def test_16_clients_get_no_errors_and_leave_nothing_in_flight(pd: Cluster) -> None:
    gateway = pd.gateway
    assert gateway is not None
    num_finished = 0

    async def client(index: int) -> None:
        nonlocal num_finished
        openai_client = pd.openai(f"key-{index % 4}")
        for round_index in range(8):
            stream = await openai_client.completions.create(
                model=MODEL_NAME, prompt=f"client {index}", max_tokens=12, stream=True
            )
            if (index + round_index) % 4 == 0:
                async for _ in stream:
                    break  # leave early: the stream is cancelled
                await stream.close()
                continue
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].choices[0].finish_reason == "length"
            num_finished += 1

    await asyncio.gather(*(client(index) for index in range(16)))
    assert num_finished == 16 * 8 - 32
    await eventually(lambda: gateway.limiter.num_in_flight == 0)
    await eventually(lambda: gateway.streamer.num_active_requests == 0)


async def test_n_choices_that_no_decode_holds_together_are_a_400_naming_n(
    cluster: Cluster,
) -> None:
    # 40 blocks of 4 tokens: one completion of 60 tokens fits (16 blocks with the prompt),
    # two fit with the prompt's blocks held once, four do not.
    await cluster.start_gateway()
    prefill = await cluster.add_prefill()
    await cluster.add_decode(num_total_blocks=40)
    body = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 60, "ignore_eos": True}
    async with cluster.http() as http:
        for n in (1, 2):
            ok = await http.post(COMPLETIONS, json={**body, "n": n})
            assert ok.status_code == 200, ok.text
            assert len(ok.json()["choices"]) == n
        num_prefills = len(prefill.requests)
        refused = await http.post(COMPLETIONS, json={**body, "n": 4})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "n")
    assert "the largest decode" in error["message"] and "has 40" in error["message"]
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME,
        text="hello there",
        n=4,
        sampling=common_pb2.SamplingParams(max_tokens=60, ignore_eos=True),
    )
    async with insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [r async for r in stub.Generate(request)]
    rpc_error = from_rpc_error(raised.value)
    assert (rpc_error.reason, rpc_error.metadata.get("param")) == (
        ErrorReason.INVALID_REQUEST,
        "n",
    )
    assert len(prefill.requests) == num_prefills  # refused before any instance worked
