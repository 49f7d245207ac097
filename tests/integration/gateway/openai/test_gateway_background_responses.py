"""Background responses and resumable chat streams on one gateway with fake instances (the
in-memory store): polled, streamed again from a sequence number or a token count after the
client left, cancelled (the lease is released), deleted, kept for ``--response-keep-s`` and
bounded by ``--max-stored-responses``, and visible only to the key that created them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest
from support.eventually import eventually
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME
from support.resumable_sse import chat_content, sse_events

BODY: dict[str, Any] = {
    "model": MODEL_NAME,
    "input": "background",
    "max_output_tokens": 12,
    "extra_body": {"seed": 7},
}


async def _ended(client: openai.AsyncOpenAI, response_id: str) -> bool:
    response = await client.responses.retrieve(response_id)
    return response.status not in ("queued", "in_progress")


async def test_a_background_response_is_polled_streamed_again_and_deleted(pd: Cluster) -> None:
    client = pd.openai()
    undisturbed = await client.responses.create(**BODY)
    created = await client.responses.create(**BODY, background=True)
    assert created.status == "queued" and created.background is True
    await eventually(lambda: _ended(client, created.id), 30, "the response ended")
    retrieved = await client.responses.retrieve(created.id)
    assert retrieved.output_text == undisturbed.output_text
    assert retrieved.status == undisturbed.status
    assert retrieved.created_at == created.created_at

    whole = [e async for e in await client.responses.retrieve(created.id, stream=True)]
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    deltas = [e.delta for e in whole if e.type == "response.output_text.delta"]
    assert len(deltas) == 12  # NOTE: one per token
    assert "".join(deltas) == undisturbed.output_text
    tail = await client.responses.retrieve(created.id, stream=True, starting_after=2)
    assert [e.model_dump() async for e in tail] == [e.model_dump() for e in whole[3:]]

    await client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(created.id)


async def test_a_client_that_left_resumes_where_it_was(pd: Cluster) -> None:
    decode = pd.decodes[0]
    decode.knobs.pause_after = 3
    client = pd.openai()
    stream = await client.responses.create(**BODY, background=True, stream=True)
    before = []
    async for event in stream:
        before.append(event)
        if event.type == "response.output_text.delta":
            break
    await stream.close()  # NOTE: the client leaves; the response runs on
    await asyncio.wait_for(decode.paused.wait(), 30)
    response_id = before[0].response.id
    polled = await client.responses.retrieve(response_id)
    assert polled.status == "in_progress"
    assert polled.output_text.startswith(before[-1].delta)
    resumed = await client.responses.retrieve(
        response_id, stream=True, starting_after=before[-1].sequence_number
    )
    decode.resume.set()
    after = [event async for event in resumed]
    events = before + after
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text


async def test_cancelling_a_running_response_releases_its_lease(pd: Cluster) -> None:
    decode = pd.decodes[0]
    decode.knobs.pause_after = 2
    client = pd.openai()
    created = await client.responses.create(**BODY, background=True)
    await asyncio.wait_for(decode.paused.wait(), 30)
    cancelled = await client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    await eventually(lambda: decode.num_open_leases == 0, 30, "the lease released")
    assert (await client.responses.retrieve(created.id)).status == "cancelled"


async def test_responses_are_kept_for_a_while_and_bounded_in_number(cluster: Cluster) -> None:
    await cluster.start_gateway(response_keep_s=0.5, max_stored_responses=1)
    await cluster.add_prefill()
    decode = await cluster.add_decode()
    client = cluster.openai()
    created = await client.responses.create(**BODY, background=True)
    await eventually(lambda: _ended(client, created.id), 30, "the response ended")

    async def gone() -> bool:
        try:
            await client.responses.retrieve(created.id)
        except openai.NotFoundError:
            return True
        return False

    await eventually(gone, 30, "the ended response expired")
    decode.knobs.pause_after = 2
    running = await client.responses.create(**BODY, background=True)
    await asyncio.wait_for(decode.paused.wait(), 30)
    # NOTE: only a running response holds its place; an ended one gives it up (the stored tests).
    with pytest.raises(openai.RateLimitError, match="max-stored-responses"):
        await client.responses.create(**BODY, background=True)
    decode.resume.set()
    await eventually(lambda: _ended(client, running.id), 30, "the response ended")
    again = await client.responses.create(**BODY, background=True)
    assert again.status == "queued"


async def test_only_the_creating_key_sees_a_response(cluster: Cluster, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice:sk-a\nbob:sk-b\n")
    await cluster.start_gateway(api_key_file=str(keys))
    await cluster.add_prefill()
    await cluster.add_decode()
    alice, bob = cluster.openai("sk-a"), cluster.openai("sk-b")
    created = await alice.responses.create(**BODY, background=True)
    for call in (
        bob.responses.retrieve(created.id),
        bob.responses.retrieve(created.id, stream=True),
        bob.responses.cancel(created.id),
        bob.responses.delete(created.id),
    ):
        with pytest.raises(openai.NotFoundError):
            await call
    await eventually(lambda: _ended(alice, created.id), 30, "alice's response ended")


async def test_a_resumable_chat_stream_is_resumed_from_a_token_count(pd: Cluster) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "resume me"}],
        "max_tokens": 10,
        "seed": 3,
        "stream": True,
    }
    async with pd.http() as http:
        plain = sse_events((await http.post("/v1/chat/completions", json=body)).text)
        resumable = {**body, "stream_options": {"resumable": True}}
        whole = await http.post("/v1/chat/completions", json=resumable)
        stream_id = whole.headers["x-request-id"]
        events = sse_events(whole.text)
        assert chat_content(events) == chat_content(plain)
        assert [event_id for event_id, _ in events][-1] == 10
        url = f"/v1/chat/completions/chatcmpl-{stream_id}/stream"
        for count in (0, 4, 10, 50):
            resumed = sse_events((await http.get(url, params={"starting_after": count})).text)
            assert chat_content(resumed) == chat_content([e for e in events if e[0] > count]), count
            assert resumed[-1][1] == "[DONE]"
            usage_chunks = [d for _, d in resumed if isinstance(d, dict) and d["choices"]]
            assert usage_chunks[-1]["choices"][0]["finish_reason"] == "length"
        refused = await http.post(
            "/v1/chat/completions", json={**resumable, "logprobs": True, "n": 1}
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "stream_options.resumable"
        missing = await http.get("/v1/chat/completions/chatcmpl-nope/stream")
        assert missing.status_code == 404
