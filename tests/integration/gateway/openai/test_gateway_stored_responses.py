"""Stored responses and ``previous_response_id`` through the openai SDK against a gateway on port
0 with fake instances (the in-memory store): a response is stored as it ends and reads back as
it was answered, streamed or not; ``store: false`` keeps nothing; a turn that names the response
before it is given that response's conversation, exactly the prompt of the conversation sent
whole, also over several turns and across a function call; its input items list; and what cannot
be continued is a 400 naming ``previous_response_id``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import responses as sdk
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME, chat_prompt_ids, expected_tokens, fake_text

SEED = 7
MAX_MODEL_LEN = 2048  # the fallback's tool instruction is long in a byte-level tokenizer


def _create(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "max_output_tokens": 6, "extra_body": {"seed": SEED}, **extra}


def _last_prompt(cluster: Cluster) -> list[int]:
    request = cluster.prefills[0].requests[-1]
    return list(request.token_ids[: request.num_prompt_tokens or None])


async def test_a_response_is_stored_as_it_ends_and_reads_back_as_answered(pd: Cluster) -> None:
    client = pd.openai()
    answered = await client.responses.create(**_create(input="hello"))
    assert answered.store is True and answered.status == "incomplete"
    read = await client.responses.retrieve(answered.id)
    assert read.model_dump() == answered.model_dump()
    sdk.Response.model_validate(read.model_dump())

    events = [e async for e in await client.responses.create(**_create(input="hi"), stream=True)]
    streamed = events[-1].response
    assert (await client.responses.retrieve(streamed.id)).model_dump() == streamed.model_dump()

    unstored = await client.responses.create(**_create(input="hello"), store=False)
    assert unstored.store is False and unstored.output_text == answered.output_text
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    await client.responses.delete(answered.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(answered.id)


async def test_a_turn_after_previous_response_id_is_the_conversation_sent_whole(
    pd: Cluster,
) -> None:
    client = pd.openai()
    first = await client.responses.create(
        **_create(input="Name a color.", instructions="Be terse.")
    )
    second = await client.responses.create(
        **_create(input="Another one.", previous_response_id=first.id)
    )
    # NOTE: the instructions are the request's own: the first turn's are not carried over.
    expected = chat_prompt_ids(
        ("user", "Name a color."), ("assistant", first.output_text), ("user", "Another one.")
    )
    assert _last_prompt(pd) == expected
    assert second.output_text == fake_text(expected_tokens(expected, SEED, 6))
    assert second.previous_response_id == first.id

    whole: list[Any] = [
        {"role": "user", "content": "Name a color."},
        *[item.model_dump() for item in first.output],
        {"role": "user", "content": "Another one."},
        *[item.model_dump() for item in second.output],
        {"role": "user", "content": "And a third."},
    ]
    sent_whole = await client.responses.create(**_create(input=whole), store=False)
    prompt_of_whole = _last_prompt(pd)
    last_turn = [{"role": "user", "content": "And a third."}]
    third = await client.responses.create(
        **_create(input=last_turn, previous_response_id=second.id)
    )
    assert _last_prompt(pd) == prompt_of_whole
    assert third.output_text == sent_whole.output_text

    page = await client.responses.input_items.list(third.id, order="asc")
    assert [(item.type, getattr(item, "role", None)) for item in page.data] == [
        ("message", "user"), ("message", "assistant"),
        ("message", "user"), ("message", "assistant"), ("message", "user"),
    ]  # fmt: skip
    assert page.data[1].id == first.output[0].id
    assert len({item.id for item in page.data}) == 5 and page.has_more is False
    latest = await client.responses.input_items.list(third.id, limit=2)
    assert [item.id for item in latest.data] == [page.data[4].id, page.data[3].id]
    assert latest.has_more is True
    rest = await client.responses.input_items.list(third.id, limit=2, after=latest.data[-1].id)
    assert [item.id for item in rest.data] == [page.data[2].id, page.data[1].id]
    # NOTE: a turn's record holds its whole conversation: the turns before it may go first.
    for earlier in (first, second):
        await client.responses.delete(earlier.id)
    assert (await client.responses.retrieve(third.id)).model_dump() == third.model_dump()
    again = await client.responses.input_items.list(third.id, order="asc")
    assert again.model_dump() == page.model_dump()


async def test_a_previous_response_id_written_with_escapes_is_read_as_one(pd: Cluster) -> None:
    client = pd.openai()
    first = await client.responses.create(**_create(input="hello"))
    body = {"model": MODEL_NAME, "input": "more", "max_output_tokens": 6, "seed": SEED,
            "previous_response_id": first.id}  # fmt: skip
    raw = json.dumps(body).replace("previous_response_id", "previous\\u005fresponse_id")
    assert "previous_response_id" not in raw
    async with pd.http() as http:
        answer = await http.post(
            "/v1/responses", content=raw, headers={"Content-Type": "application/json"}
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["previous_response_id"] == first.id
    assert _last_prompt(pd) == chat_prompt_ids(
        ("user", "hello"), ("assistant", first.output_text), ("user", "more")
    )


async def test_a_background_response_is_continued_once_it_ended(pd: Cluster) -> None:
    decode = pd.decodes[0]
    decode.knobs.pause_after = 2
    client = pd.openai()
    created = await client.responses.create(**_create(input="hello"), background=True)
    await asyncio.wait_for(decode.paused.wait(), 30)
    with pytest.raises(openai.BadRequestError, match="is in_progress") as running:
        await client.responses.create(**_create(input="more", previous_response_id=created.id))
    assert running.value.body["param"] == "previous_response_id"  # type: ignore[index]
    decode.resume.set()
    while (await client.responses.retrieve(created.id)).status == "in_progress":
        await asyncio.sleep(0.05)
    ended = await client.responses.retrieve(created.id)
    after = await client.responses.create(
        **_create(input="more", previous_response_id=created.id), background=True
    )
    while (await client.responses.retrieve(after.id)).status in ("queued", "in_progress"):
        await asyncio.sleep(0.05)
    assert _last_prompt(pd) == chat_prompt_ids(
        ("user", "hello"), ("assistant", ended.output_text), ("user", "more")
    )


@pytest.mark.parametrize(
    "previous",
    ["resp_unknown", "not-a-response-id", "unstored", "cancelled", "another_keys"],
)
async def test_what_cannot_be_continued_is_a_400_naming_previous_response_id(
    cluster: Cluster, tmp_path: Path, previous: str
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice:sk-a\nbob:sk-b\n")
    await cluster.start_gateway(api_key_file=str(keys))
    await cluster.add_prefill()
    decode = await cluster.add_decode()
    alice, bob = cluster.openai("sk-a"), cluster.openai("sk-b")
    response_id = previous
    if previous == "unstored":
        response_id = (await alice.responses.create(**_create(input="x"), store=False)).id
    elif previous == "another_keys":
        response_id = (await bob.responses.create(**_create(input="x"))).id
    elif previous == "cancelled":
        decode.knobs.pause_after = 1
        response_id = (await alice.responses.create(**_create(input="x"), background=True)).id
        await asyncio.wait_for(decode.paused.wait(), 30)
        await alice.responses.cancel(response_id)
    num_sent = len(cluster.prefills[0].requests)
    async with cluster.http() as http:
        answer = await http.post(
            "/v1/responses",
            json={"model": MODEL_NAME, "input": "y", "previous_response_id": response_id},
            headers={"Authorization": "Bearer sk-a"},
        )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("previous_response_id", "invalid_request")
    words = "is cancelled" if previous == "cancelled" else "no stored response"
    assert words in error["message"]
    assert len(cluster.prefills[0].requests) == num_sent


@pytest.mark.parametrize(
    ("new_input", "param", "words"),
    [
        ([{"type": "function_call_output", "call_id": "c9", "output": "1"}],
         "input[0].call_id", "input[0].call_id 'c9' answers no function_call"),
        ([{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}],
         "input", "input.1.role"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
         "input[0].content[0]", "'input_image'"),
    ],
)  # fmt: skip
async def test_a_refused_item_of_a_continuation_is_named_as_its_client_sent_it(
    pd: Cluster, new_input: list[Any], param: str, words: str
) -> None:
    client = pd.openai()
    first = await client.responses.create(**_create(input="hello"))
    async with pd.http() as http:
        answer = await http.post(
            "/v1/responses",
            json={"model": MODEL_NAME, "input": new_input, "previous_response_id": first.id},
        )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error


async def test_a_function_call_is_answered_by_its_call_id_in_the_next_turn(
    cluster: Cluster,
) -> None:
    await cluster.start_gateway()
    await cluster.add_prefill(max_model_len=MAX_MODEL_LEN)
    await cluster.add_decode(max_model_len=MAX_MODEL_LEN)
    tools: list[Any] = [{"type": "function", "name": "get_weather", "strict": False,
                         "parameters": {"type": "object", "properties": {"city": {}}}}]  # fmt: skip
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>'
    cluster.script(call)
    client = cluster.openai()
    asked = await client.responses.create(
        model=MODEL_NAME, input="Weather in Bern?", tools=tools, max_output_tokens=200
    )
    [made] = asked.output
    assert made.type == "function_call"
    # NOTE: read back (made again from its tokens), the call has the id its client saw.
    assert (await client.responses.retrieve(asked.id)).output[0].model_dump() == made.model_dump()
    cluster.script("Sunny.")
    output = {"type": "function_call_output", "call_id": made.call_id, "output": "18 C"}
    answer = await client.responses.create(
        model=MODEL_NAME, input=[output], tools=tools, previous_response_id=asked.id,
        max_output_tokens=200,
    )  # fmt: skip
    continued = _last_prompt(cluster)
    asked_again = {"role": "user", "content": "Weather in Bern?"}
    whole = [asked_again, made.model_dump(exclude_none=True), output]
    await client.responses.create(
        model=MODEL_NAME, input=whole, tools=tools, max_output_tokens=200, store=False
    )
    assert continued == _last_prompt(cluster)
    assert answer.output_text == "Sunny."


async def test_a_full_store_makes_room_by_its_oldest_ended_response(cluster: Cluster) -> None:
    await cluster.start_gateway(max_stored_responses=2)
    await cluster.add_prefill()
    decode = await cluster.add_decode()
    client = cluster.openai()
    first, second, third = [
        await client.responses.create(**_create(input=word)) for word in ("a", "b", "c")
    ]
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text
    decode.knobs.pause_after = 2
    running = [
        await client.responses.create(**_create(input=word), background=True) for word in "de"
    ]
    await asyncio.wait_for(decode.paused.wait(), 30)
    for gone in (second, third):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(gone.id)
    with pytest.raises(openai.RateLimitError, match="max-stored-responses"):
        await client.responses.create(**_create(input="f"), background=True)
    decode.resume.set()
    for response in running:
        while (await client.responses.retrieve(response.id)).status == "in_progress":
            await asyncio.sleep(0.05)
    assert (await client.responses.create(**_create(input="f"), background=True)).id


async def test_input_items_of_an_unknown_response_are_a_404(pd: Cluster) -> None:
    async with pd.http() as http:
        response = await http.get("/v1/responses/resp_1/input_items")
        refused = await http.get("/v1/responses/resp_1/input_items?limit=0")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "request_not_found"
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "limit"
