"""The gateway in front of real prefill and decode services, through the openai SDK.

The reference engine runs in a worker thread: the services share this event loop.

Every answer is compared with the single-process engine (invariant 1), and every instance's
block pool must be whole afterwards (invariant 3).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.eventually import eventually
from support.real_cluster import BLOCK_SIZE, MODEL_NAME, RealCluster, Reference

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Tell me about PD disaggregation."}]


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> Reference:
    return Reference(demo_model_dir)


@pytest.fixture
async def cluster(
    demo_model_dir: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[RealCluster]:
    options: dict[str, Any] = dict(getattr(request, "param", {}))
    if options.pop("kv_store", False):
        options["instance_settings"] = {"kv_store": f"file:{tmp_path / 'kv'}"}
    real = RealCluster(demo_model_dir)
    try:
        yield await real.start(**options)
    finally:
        await real.close()


def _ids(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


async def _streamed_greedy(
    client: openai.AsyncOpenAI, prompts: list[str], max_tokens: int
) -> list[list[int]]:
    """The token ids of greedy completions of `prompts`, all streamed at once."""

    async def one(prompt: str) -> list[int]:
        ids: list[int] = []
        chunks = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        async for chunk in chunks:
            for choice in chunk.choices:
                ids.extend(_ids(choice))
        return ids

    return list(await asyncio.gather(*(one(p) for p in prompts)))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_completions_equal_the_engine(
    cluster: RealCluster, reference: Reference, stream: bool
) -> None:
    client = cluster.openai()
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
              "extra_body": {"return_token_ids": True}}  # fmt: skip
    expected = await asyncio.to_thread(reference.completion, PROMPT, temperature=0.0, max_tokens=20)
    if stream:
        ids, text, usage = [], "", None
        chunks = await client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                ids.extend(_ids(choice))
                text += choice.text
    else:
        response = await client.completions.create(**kwargs)
        ids, text, usage = _ids(response.choices[0]), response.choices[0].text, response.usage
    assert ids == expected
    assert text == reference.text(expected)
    assert usage is not None
    assert usage.prompt_tokens == len(reference.tokenizer.encode(PROMPT))
    assert usage.completion_tokens == len(expected)
    await cluster.assert_whole()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_seeded_chat_equals_the_engine(
    cluster: RealCluster, reference: Reference, stream: bool
) -> None:
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 24}
    expected = await asyncio.to_thread(reference.chat, MESSAGES, **sampling)
    client = cluster.openai()
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, **sampling,
              "extra_body": {"return_token_ids": True}}  # fmt: skip
    if stream:
        ids: list[int] = []
        async for chunk in await client.chat.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                ids.extend(_ids(choice))
        assert ids == expected
    else:
        response = await client.chat.completions.create(**kwargs)
        assert _ids(response.choices[0]) == expected
        assert response.choices[0].message.content == reference.text(expected)
        assert response.usage.prompt_tokens == len(reference.tokenizer.encode_chat(MESSAGES))
    await cluster.assert_whole()


def _counter(text: str, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith(name)
    )


STORM = {"decode_overrides": [{"num_blocks": 20, "reserve_tokens": 0}], "preempt_retry_count": 50}


@pytest.mark.parametrize(
    "cluster",
    # 20 blocks of 16 tokens and no growth headroom: 8 long streams must preempt each other;
    # with the KV store on, preempted requests are offloaded and reloaded on reschedule.
    [STORM, {**STORM, "kv_store": True}],
    indirect=True,
    ids=["no-store", "kv-store"],
)
async def test_preemption_storm_is_invisible_to_clients(
    cluster: RealCluster, reference: Reference
) -> None:
    client = cluster.openai()
    prompts = [f"{PROMPT} number {i}" for i in range(8)]
    expected = [
        await asyncio.to_thread(reference.completion, p, temperature=0.0, max_tokens=48)
        for p in prompts
    ]

    # NOTE: the streams preempt each other only where enough of them run at once; where the
    # decode refused some at first and they came in as others ended, none was preempted: the
    # storm runs again (up to three rounds), every round's output checked.
    for _ in range(3):
        results = await _streamed_greedy(client, prompts, max_tokens=48)
        assert results == expected
        metrics = (await cluster.http().get("/metrics")).text
        if _counter(metrics, "pdserve_gateway_reschedules") > 0:
            break
    assert _counter(metrics, "pdserve_gateway_reschedules") > 0
    for decode in cluster.decodes:
        if decode.offload is not None:
            assert decode.offload.num_written > 0
    await cluster.assert_whole()


@pytest.mark.parametrize("cluster", [{"decodes": 2}], indirect=True)
async def test_stream_survives_a_decode_stopped_mid_stream(
    cluster: RealCluster, reference: Reference
) -> None:
    expected = await asyncio.to_thread(
        reference.completion, PROMPT, temperature=0.0, max_tokens=200
    )
    client = cluster.openai()
    chunks = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    ids: list[int] = []
    victim = None
    async for chunk in chunks:
        for choice in chunk.choices:
            ids.extend(_ids(choice))
        if victim is None and len(ids) >= 10:
            victim = next(d for d in cluster.decodes if d.leases.table.open_leases())
            await victim.stop(grace=None)  # the decode is gone, mid-stream
    assert victim is not None
    assert ids == expected
    cluster.decodes.remove(victim)
    await cluster.assert_whole()


@pytest.mark.parametrize(
    "cluster", [{"decode_overrides": [{"num_blocks": 4}], "max_attempts": 2}], indirect=True
)
async def test_a_request_no_decode_could_ever_hold_is_refused_at_once(
    cluster: RealCluster,
) -> None:
    long_prompt = "word " * 100  # > 4 blocks of 16 tokens: waiting would never end
    async with cluster.http() as http:
        response = await http.post(
            "/v1/completions",
            json={"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": 8},
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "prompt_too_long"
    assert "KV blocks" in error["message"]
    await cluster.assert_whole()


@pytest.mark.parametrize("cluster", [{"decode_overrides": [{"num_blocks": 24}]}], indirect=True)
async def test_more_streams_than_the_decode_holds_queue_and_equal_the_engine(
    cluster: RealCluster, reference: Reference
) -> None:
    # NOTE: 24 blocks of 16 tokens; each stream needs 4 of them to start (its prompt and the
    # decode's headroom) and 5 by its end: 16 of them at once would need 80.
    client = cluster.openai()
    prompts = [f"{PROMPT} number {i}" for i in range(16)]
    expected = [
        await asyncio.to_thread(reference.completion, p, temperature=0.0, max_tokens=40)
        for p in prompts
    ]

    results = await _streamed_greedy(client, prompts, max_tokens=40)
    assert results == expected
    metrics = (await cluster.http().get("/metrics")).text
    assert _counter(metrics, "pdserve_gateway_queue_wait_seconds_count") > 0  # some waited
    assert _counter(metrics, "pdserve_gateway_queue_refusals") == 0
    assert 'pdserve_gateway_requests_total{outcome="finished"} 16.0' in metrics
    await cluster.assert_whole()


async def test_client_disconnect_mid_stream_frees_both_pools(cluster: RealCluster) -> None:
    client = cluster.openai()
    chunks = await client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1000, temperature=0, stream=True
    )
    received = 0
    async for _ in chunks:
        received += 1
        if received == 5:
            break
    await chunks.close()
    await cluster.assert_whole(timeout_s=10)


async def test_bad_input_is_refused_before_any_work(cluster: RealCluster) -> None:
    client = cluster.openai()
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="nope", prompt=PROMPT, max_tokens=4)
    status = await cluster.pool_status(cluster.decodes[0].address)
    assert status.pool.num_free_blocks == status.pool.num_total_blocks


def _total(text: str, name: str) -> float:
    """The value of counter `name` (its ``_total`` sample) in a /metrics page."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == f"{name}_total"
    )


async def _prefill_totals(cluster: RealCluster, name: str) -> dict[str, float]:
    """Counter `name` of every prefill, by instance id, from its own /metrics."""
    totals = {}
    async with httpx.AsyncClient(timeout=10.0) as http:
        for prefill in cluster.prefills:
            page = await http.get(f"http://{prefill.instance.metrics_address}/metrics")
            totals[prefill.instance.instance_id] = _total(page.text, name)
    return totals


def _gateway_sees_idle_prefills(cluster: RealCluster) -> bool:
    gateway = cluster.gateway
    entries = [gateway.registry.get(p.instance.instance_id) for p in cluster.prefills]
    return all(
        entry is not None
        and entry.load.num_queued_prompt_tokens == 0
        and gateway.router.loads.unreported_work(entry.instance_id) <= 0
        for entry in entries
    )


@pytest.mark.parametrize("cluster", [{"prefills": 2}], indirect=True)
async def test_a_shared_prefix_stays_on_the_prefill_that_cached_it(
    cluster: RealCluster, reference: Reference
) -> None:
    client = cluster.openai()
    prefix = " ".join(f"rule {i}: answer briefly and politely." for i in range(40))
    prompts = [f"{prefix} Question {i}: what is {i} plus {i}?" for i in range(5)]
    num_prefix_tokens = len(reference.tokenizer.encode(prefix))
    assert num_prefix_tokens >= 10 * BLOCK_SIZE
    for prompt in prompts:  # one after another: each finds the previous ones cached
        answer = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
    expected = await asyncio.to_thread(reference.completion, prompts[-1], temperature=0.0,
                                       max_tokens=4)  # fmt: skip
    assert _ids(answer.choices[0]) == expected
    cached = await _prefill_totals(cluster, "pdserve_prefill_cached_prompt_tokens")
    computed = await _prefill_totals(cluster, "pdserve_prefill_prompt_tokens")
    holder = max(cached, key=lambda instance_id: cached[instance_id])
    # NOTE: the first prompt computes the prefix, the four after it take it from the cache.
    assert cached[holder] >= 4 * (num_prefix_tokens // BLOCK_SIZE - 1) * BLOCK_SIZE
    assert [computed[i] for i in computed if i != holder] == [0]
    gateway_metrics = (await cluster.http().get("/metrics")).text
    routes = {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(gateway_metrics)
        for s in f.samples
        if s.name == "pdserve_gateway_routes_total"
    }
    assert routes == {"load": 1, "prefix": 4}

    # Unrelated prompts (no shared first block) still spread over both prefills by load. A
    # report taken while the last prompt was queued may reach the gateway after that prompt
    # settled (it looks busy until the next report): wait until the gateway sees both idle.
    await eventually(lambda: _gateway_sees_idle_prefills(cluster), 30, "idle prefills")
    unrelated = [f"{i} {'different words ' * 12}" for i in range(8)]
    await asyncio.gather(
        *(client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=2) for p in unrelated)
    )
    after = await _prefill_totals(cluster, "pdserve_prefill_prompt_tokens")
    assert all(after[i] > computed[i] for i in after), (computed, after)
    await cluster.assert_whole()
