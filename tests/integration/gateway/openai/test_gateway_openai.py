"""The OpenAI-compatible REST API through the openai SDK against a gateway on port 0."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.eventually import eventually
from support.gateway_cluster import Cluster
from support.gateway_fakes import (
    CHAT_TEMPLATE,
    EOS_TOKEN_ID,
    MODEL_NAME,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    expected_tokens,
    fake_text,
)

from pdserve.common.grpc_server import insecure_channel
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

PROMPT = "hello world"
PROMPT_IDS = list(PROMPT.encode())


def _chat_prompt_ids(content: str) -> list[int]:
    # <|user|> = 258, <|assistant|> = 259 in the fake tokenizer (see CHAT_TEMPLATE).
    assert "<|{{ m.role }}|>" in CHAT_TEMPLATE
    return [258, *content.encode(), 259]


async def test_completion_matches_reference_with_exact_usage(pd: Cluster) -> None:
    client = pd.openai()
    result = await client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=9,
        seed=11,
        extra_body={"return_token_ids": True},
    )
    expected = expected_tokens(PROMPT_IDS, 11, 9)
    choice = result.choices[0]
    assert choice.text == fake_text(expected)
    assert choice.finish_reason == "length"
    assert choice.model_extra["token_ids"] == expected
    assert choice.model_extra["prompt_token_ids"] == PROMPT_IDS
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(PROMPT_IDS), 9)
    assert result.usage.total_tokens == len(PROMPT_IDS) + 9
    assert pd.decodes[0].num_open_leases == 0


async def test_streamed_completion_equals_non_streamed(pd: Cluster) -> None:
    client = pd.openai()
    stream = await client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=14,
        seed=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == fake_text(expected_tokens(PROMPT_IDS, 5, 14))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 14
    assert all(c.usage is None for c in chunks[:-1])


async def test_chat_stream_and_non_stream(pd: Cluster) -> None:
    client = pd.openai()
    messages = [{"role": "user", "content": "hi there"}]
    expected = expected_tokens(_chat_prompt_ids("hi there"), 3, 10)
    result = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, seed=3
    )
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == fake_text(expected)
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(_chat_prompt_ids("hi there"))
    assert result.usage.completion_tokens == 10

    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, seed=3, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == fake_text(expected)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_sse_wire_format_ends_with_done(pd: Cluster) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "seed": 1, "stream": True}
    async with pd.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join([part async for part in response.aiter_text()])
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert all(event.startswith("data: ") for event in events[:-1])
    assert events[-2] == "data: [DONE]"
    payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert "".join(p["choices"][0]["text"] for p in payloads) == fake_text(
        expected_tokens(PROMPT_IDS, 1, 5)
    )


async def test_token_id_prompt_and_stop_token_id(pd: Cluster) -> None:
    reference = expected_tokens(PROMPT_IDS, 2, 20)
    stop_id = reference[4]
    result = await pd.openai().completions.create(
        model=MODEL_NAME,
        prompt=PROMPT_IDS,
        max_tokens=20,
        seed=2,
        extra_body={"stop_token_ids": [stop_id], "return_token_ids": True},
    )
    choice = result.choices[0]
    expected = expected_tokens(PROMPT_IDS, 2, 20, stop_token_ids=[stop_id])
    assert choice.model_extra["token_ids"] == expected
    assert choice.finish_reason == "stop"
    assert result.usage is not None and result.usage.completion_tokens == len(expected)


async def test_stop_string_across_tokens_ends_early_and_releases_the_lease(pd: Cluster) -> None:
    reference = expected_tokens(PROMPT_IDS, 4, 30)
    text = fake_text(reference)
    stop = text[7:10]  # three characters, so three tokens: spans token boundaries
    assert text.find(stop) == 7
    client = pd.openai()
    for is_stream in (False, True):
        if is_stream:
            stream = await client.completions.create(
                model=MODEL_NAME,
                prompt=PROMPT,
                max_tokens=30,
                seed=4,
                stop=[stop, "never-there"],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            output = "".join(c.choices[0].text for c in chunks if c.choices)
            finish_reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            result = await client.completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=30, seed=4, stop=stop
            )
            output, finish_reason = result.choices[0].text, result.choices[0].finish_reason
            usage = result.usage
        assert output == text[:7]
        assert finish_reason == "stop"
        assert usage is not None and usage.completion_tokens == 10  # through the stop's end
    await pd.gateway.orchestrator.wait_for_cleanups()  # type: ignore[union-attr]
    assert pd.decodes[0].num_open_leases == 0


async def test_eos_from_decode_ends_with_stop(pd: Cluster) -> None:
    pd.decodes[0].knobs.eos_index = 6
    result = await pd.openai().completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=20,
        seed=9,
        extra_body={"return_token_ids": True},
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"][-1] == EOS_TOKEN_ID
    assert len(choice.model_extra["token_ids"]) == 7
    assert choice.text == fake_text(choice.model_extra["token_ids"][:-1])  # EOS is not text


async def test_max_tokens_one_finishes_on_prefill(pd: Cluster) -> None:
    result = await pd.openai().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, seed=9
    )
    assert result.choices[0].text == fake_text(expected_tokens(PROMPT_IDS, 9, 1))
    assert result.choices[0].finish_reason == "length"
    assert pd.decodes[0].generate_calls == []


async def test_models_health_and_metrics(pd: Cluster) -> None:
    models = await pd.openai().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    async with pd.http() as http:
        health = await http.get("/health")
        assert health.status_code == 200
        assert health.json()["models"] == [MODEL_NAME]
        await pd.openai().completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
        metrics = await http.get("/metrics")
    assert 'pdserve_gateway_requests_total{outcome="finished"} 1.0' in metrics.text


async def test_grpc_generate_returns_the_same_tokens_as_rest(pd: Cluster) -> None:
    rest = await pd.openai().completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=12,
        seed=8,
        extra_body={"return_token_ids": True},
    )
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME,
        text=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=12, seed=8),
        request_id="my-request",
        include_prompt_token_ids=True,
    )
    async with insecure_channel(pd.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        responses = [r async for r in stub.Generate(request)]
        listed = await stub.ListModels(generation_pb2.ListModelsRequest())
    token_ids = [t for r in responses for t in r.token_ids]
    assert token_ids == rest.choices[0].model_extra["token_ids"]
    assert "".join(r.text for r in responses) == rest.choices[0].text
    indices = [r.first_index for r in responses if r.token_ids]
    assert indices == sorted(indices) and indices[0] == 0
    assert list(responses[0].prompt_token_ids) == PROMPT_IDS
    assert all(r.request_id == "my-request" for r in responses)
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.num_completion_tokens == 12
    assert [(m.name, m.num_prefill_instances, m.num_decode_instances) for m in listed.models] == [
        (MODEL_NAME, 1, 1)
    ]


async def test_grpc_generate_refuses_bad_input_with_a_typed_error(pd: Cluster) -> None:
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME, text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=0)
    )
    async with insecure_channel(pd.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            [r async for r in stub.Generate(request)]
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        else:
            raise AssertionError("max_tokens=0 was accepted")
    assert pd.prefills[0].requests == []


async def test_local_tokenizer_directory_replaces_get_model_info(
    cluster: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "tokenizer.json").write_text(TOKENIZER_JSON)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    await cluster.start_gateway(tokenizer=str(tmp_path))
    prefill = await cluster.add_prefill()
    await cluster.add_decode()
    result = await cluster.openai().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi there"}], max_tokens=4, seed=3
    )
    assert result.choices[0].message.content == fake_text(
        expected_tokens(_chat_prompt_ids("hi there"), 3, 4)
    )
    assert prefill.num_model_info_calls == 0


async def test_small_responses_are_not_held_back_by_delayed_acks(pd: Cluster) -> None:
    # Without TCP_NODELAY on accepted sockets each response waits ~40 ms for a delayed ACK.
    async with pd.http() as http:
        await http.get("/health")
        durations = []
        for _ in range(9):
            started = time.perf_counter()
            await http.get("/health")
            durations.append(time.perf_counter() - started)
    assert statistics.median(durations) < 0.03


async def _generation_health(cluster: Cluster) -> int:
    async with insecure_channel(cluster.grpc_address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.GenerationService")
        )
    return int(reply.status)


async def test_readiness_waits_for_a_compatible_pair(cluster: Cluster) -> None:
    # A probe or script that waits for /health must not send its first request into a 404.
    await cluster.start_gateway()
    serving = health_pb2.HealthCheckResponse.SERVING
    async with cluster.http() as http:
        assert (await http.get("/livez")).status_code == 200
        for step in ("empty", "prefill only"):
            health = await http.get("/health")
            assert health.status_code == 503, step
            assert health.json()["status"] == "not_ready"
            assert health.json()["reason"]
            assert await _generation_health(cluster) != serving
            if step == "empty":
                await cluster.add_prefill()
        await cluster.add_decode()
        health = await http.get("/health")
        assert health.status_code == 200
        assert health.json()["models"] == [MODEL_NAME]

        async def is_serving() -> bool:
            return await _generation_health(cluster) == serving

        await eventually(is_serving, what="GenerationService SERVING")
