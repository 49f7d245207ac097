"""The Responses API (``POST /v1/responses``) through the openai SDK against a gateway on port 0
with fake instances: the same tokens as the chat path, the Response object, its events, the
constraint ``text.format`` becomes, and the 400s of what is refused."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import structlog
from openai.types import responses as sdk
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME, chat_prompt_ids, expected_tokens, fake_text
from support.responses_events import SDK_EVENTS

from pdserve.gateway.prepare.workers import INLINE_PARSE_BYTES
from pdserve.v1 import common_pb2

SEED = 7
EVENT_TYPES = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def _collapsed(types: list[str]) -> list[str]:
    """Event types with runs of text deltas as one."""
    return [t for i, t in enumerate(types) if not (i and t == types[i - 1])]


async def test_response_equals_the_chat_completion_of_the_same_messages(pd: Cluster) -> None:
    client = pd.openai()
    response = await client.responses.create(
        model=MODEL_NAME,
        instructions="Answer briefly.",
        input="What is PD?",
        max_output_tokens=12,
        extra_body={"seed": SEED},
    )
    chat = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is PD?"},
        ],
        max_tokens=12,
        seed=SEED,
    )
    prompt_ids = chat_prompt_ids(("system", "Answer briefly."), ("user", "What is PD?"))
    assert response.output_text == chat.choices[0].message.content
    assert response.output_text == fake_text(expected_tokens(prompt_ids, SEED, 12))
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL_NAME
    assert [item.type for item in response.output] == ["message"]
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert [part.type for part in message.content] == ["output_text"]
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.output_tokens == chat.usage.completion_tokens == 12
    assert response.usage.total_tokens == len(prompt_ids) + 12
    assert response.instructions == "Answer briefly."
    assert response.max_output_tokens == 12
    assert pd.decodes[0].num_open_leases == 0


async def test_a_response_that_ends_is_completed(pd: Cluster) -> None:
    pd.decodes[0].knobs.eos_index = 5
    response = await pd.openai().responses.create(
        model=MODEL_NAME, input="hi", max_output_tokens=20, extra_body={"seed": SEED}
    )
    assert response.status == "completed"
    assert response.incomplete_details is None
    assert response.output[0].status == "completed"
    assert response.output_text == fake_text(
        expected_tokens(chat_prompt_ids(("user", "hi")), SEED, 5)
    )
    assert response.usage is not None and response.usage.output_tokens == 6  # EOS included


async def test_cache_and_safety_fields_and_max_tool_calls_are_taken_and_repeated(
    pd: Cluster,
) -> None:
    """OpenAI's request-level fields that change no token: repeated in the response; the
    safety identifier is the request's user in the logs when ``user`` is unset."""
    with structlog.testing.capture_logs() as logs:
        response = await pd.openai().responses.create(
            model=MODEL_NAME, input="hi", max_output_tokens=3, prompt_cache_key="thread-7",
            prompt_cache_retention="24h", safety_identifier="person-42", max_tool_calls=2,
        )  # fmt: skip
    assert response.prompt_cache_key == "thread-7" and response.prompt_cache_retention == "24h"
    assert response.safety_identifier == "person-42" and response.max_tool_calls == 2
    (finished,) = [e for e in logs if e["event"] == "request_finished"]
    assert finished["user"] == "person-42"
    with structlog.testing.capture_logs() as logs:
        chat = await pd.openai().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
            prompt_cache_key="thread-7", safety_identifier="person-43", user="named",
        )  # fmt: skip
    assert chat.choices[0].message.content is not None
    (finished,) = [e for e in logs if e["event"] == "request_finished"]
    assert finished["user"] == "named"  # NOTE: `user`, when set, stays the user


async def test_max_output_tokens_makes_an_incomplete_response(pd: Cluster) -> None:
    response = await pd.openai().responses.create(
        model=MODEL_NAME, input="hi", max_output_tokens=4, extra_body={"seed": SEED}
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.usage is not None and response.usage.output_tokens == 4


async def test_input_items_are_the_chat_messages_they_name(pd: Cluster) -> None:
    client = pd.openai()
    first = await client.responses.create(
        model=MODEL_NAME, input="Name a color.", max_output_tokens=6, extra_body={"seed": SEED}
    )
    # NOTE: the first response's output goes back as input, as a stateless client does.
    items: list[Any] = [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]},
        *[item.model_dump() for item in first.output],
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Another "}, {"type": "input_text", "text": "one."}]},
    ]  # fmt: skip
    response = await client.responses.create(
        model=MODEL_NAME, input=items, max_output_tokens=8, extra_body={"seed": SEED}
    )
    chat = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Another one."},
        ],
        max_tokens=8,
        seed=SEED,
    )
    assert response.output_text == chat.choices[0].message.content
    prompt_ids = chat_prompt_ids(
        ("system", "Be terse."),
        ("user", "Name a color."),
        ("assistant", first.output_text),
        ("user", "Another one."),
    )
    assert response.usage is not None and response.usage.input_tokens == len(prompt_ids)
    assert response.output_text == fake_text(expected_tokens(prompt_ids, SEED, 8))


async def test_a_large_body_parses_in_a_worker_process(pd: Cluster) -> None:
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 5, "seed": SEED}
    raw = json.dumps(body) + " " * (INLINE_PARSE_BYTES + 1)  # whitespace: same request
    headers = {"Content-Type": "application/json"}
    async with pd.http() as http:
        response = await http.post("/v1/responses", content=raw, headers=headers)
    assert response.status_code == 200, response.text
    text = response.json()["output"][0]["content"][0]["text"]
    assert text == fake_text(expected_tokens(chat_prompt_ids(("user", "hi")), SEED, 5))


async def test_streamed_events_are_numbered_and_add_up_to_the_response(pd: Cluster) -> None:
    client = pd.openai()
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "input": "hello", "max_output_tokens": 9,
                              "extra_body": {"seed": SEED}}  # fmt: skip
    whole = await client.responses.create(**kwargs)
    events = [event async for event in await client.responses.create(**kwargs, stream=True)]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    types = [event.type for event in events]
    assert _collapsed(types) == [*EVENT_TYPES, "response.incomplete"]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and all(deltas)
    done = next(event for event in events if event.type == "response.output_text.done")
    assert "".join(deltas) == done.text == whole.output_text
    created, last = events[0], events[-1]
    assert created.type == "response.created" and last.type == "response.incomplete"
    assert created.response.status == "in_progress" and created.response.output == []
    assert last.response.id == created.response.id
    assert last.response.output_text == whole.output_text
    assert last.response.usage == whole.usage
    item_ids = {getattr(event, "item_id", None) for event in events} - {None}
    assert item_ids == {last.response.output[0].id}


async def test_the_stream_helper_gives_the_final_response(pd: Cluster) -> None:
    pd.decodes[0].knobs.eos_index = 7
    client = pd.openai()
    async with client.responses.stream(
        model=MODEL_NAME, input="hello", max_output_tokens=20, extra_body={"seed": SEED}
    ) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert final.status == "completed"
    expected = fake_text(expected_tokens(chat_prompt_ids(("user", "hello")), SEED, 7))
    assert "".join(deltas) == final.output_text == expected


async def test_a_stream_that_fails_after_its_start_ends_with_error_and_failed(
    cluster: Cluster,
) -> None:
    await cluster.start_gateway(request_timeout=1.0)
    await cluster.add_prefill()
    decode = await cluster.add_decode()
    decode.knobs.pause_after = 3  # the stream stalls until the gateway's timeout
    stream = await cluster.openai().responses.create(
        model=MODEL_NAME, input="hello", max_output_tokens=20, stream=True
    )
    events = [event async for event in stream]
    decode.resume.set()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events][-2:] == ["error", "response.failed"]
    error, failed = events[-2:]
    assert error.type == "error" and error.code == "deadline_exceeded"
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error is not None
    assert failed.response.error.code == "deadline_exceeded"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed and failed.response.output[0].content[0].text == streamed


@pytest.mark.parametrize(
    ("text", "constraint"),
    [
        (None, None),
        ({"format": {"type": "text"}}, None),
        ({"format": {"type": "json_object"}}, common_pb2.Constraint(json_object=True)),
        (
            {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}},
            common_pb2.Constraint(json_schema=json.dumps(SCHEMA)),
        ),
    ],
    ids=["absent", "text", "json_object", "json_schema"],
)
async def test_text_format_is_the_constraint_the_prefill_receives(
    pd: Cluster, text: dict[str, Any] | None, constraint: common_pb2.Constraint | None
) -> None:
    body: dict[str, Any] = {"model": MODEL_NAME, "input": "A city?", "max_output_tokens": 3}
    if text is not None:
        body["text"] = text
    async with pd.http() as http:
        response = await http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    sampling = pd.prefills[0].requests[-1].sampling
    if constraint is None:
        assert not sampling.HasField("constraint")
    else:
        assert sampling.constraint == constraint
    assert response.json()["text"] == (text or {"format": {"type": "text"}})


@pytest.mark.parametrize("eos_index", [None, 3], ids=["incomplete", "completed"])
async def test_bodies_and_events_validate_against_the_sdk_models(
    pd: Cluster, eos_index: int | None
) -> None:
    # NOTE: the SDK builds its objects without validating them; here every field is checked.
    pd.decodes[0].knobs.eos_index = eos_index
    text_format = {"type": "json_schema", "name": "city", "schema": SCHEMA}
    body = {"model": MODEL_NAME, "input": "hi", "max_output_tokens": 6,
            "text": {"format": text_format}}  # fmt: skip
    async with pd.http() as http:
        whole = (await http.post("/v1/responses", json=body)).json()
        request = http.stream("POST", "/v1/responses", json={**body, "stream": True})
        async with request as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            raw = "".join([part async for part in response.aiter_text()])
    sdk.Response.model_validate(whole)
    events = raw.split("\n\n")
    assert events[-1] == ""
    for event in events[:-1]:
        name, data = event.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        SDK_EVENTS[payload["type"]].model_validate(payload)
    assert json.loads(events[-2].split("data: ")[1])["response"]["status"] == whole["status"]


REFUSED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "no stored response"),
    ({"conversation": "conv_1"}, "conversation", "conversation objects are not supported"),
    ({"background": True, "store": False}, "store", "store must be true"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "web_search"}]},
     "tools[1]", "'web_search'"),
    ({"tools": [{"type": "function", "name": "has space"}]}, "tools[0].name", "a-z"),
    ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]},
     "tools[1].name", "not unique"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "web_search"}},
     "tool_choice", "'web_search'"),
    ({"tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", "not one of the tools"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "42"}]},
     "input[0].call_id", "answers no function_call"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1",
                 "output": [{"type": "input_image", "image_url": "x"}]}]},
     "input[1].output[0]", "'input_image'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "'item_reference'"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gA"}]},
     "input[0].encrypted_content", "encrypted reasoning"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[1]", "'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
     "input[0].content[0]", "assistant messages"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input.0.role"),
    ({"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, "include[1]",
     "'reasoning.encrypted_content' is not supported"),
    ({"include": ["message.output_text.logprobs"], "background": True}, "include",
     "a background response cannot return logprobs"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning", "reasoning.summary"),
    ({"truncation": "middle"}, "truncation", "truncation"),
    ({"top_logprobs": 21}, "top_logprobs", "0 to 20"),
    ({"text": {"format": {"type": "yaml"}}}, "text", "'yaml'"),
    ({"text": {"format": {"type": "json_schema", "name": "has space", "schema": {}}}},
     "text", "pattern"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strang"}}}},
     "text.format", "does not compile"),
    ({"text": {"format": {"type": "json_object"}}, "ignore_eos": True}, "ignore_eos",
     "ignore_eos cannot be combined with text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"prompt_cache_key_v2": "k"}, "prompt_cache_key_v2", "unrecognized request argument"),
    ({"safety_identifier": "u" * 65}, "safety_identifier", "at most 64 characters"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention", "prompt_cache_retention"),
    ({"max_tool_calls": 0}, "max_tool_calls", "max_tool_calls"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "param", "words"), REFUSED, ids=[r[1] for r in REFUSED])
async def test_what_is_not_supported_is_a_400_naming_it(
    pd: Cluster, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {"model": MODEL_NAME, "input": "hi", **extra}
    async with pd.http() as http:
        response = await http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_request")
    assert words in error["message"]
    assert pd.prefills[0].requests == []


async def test_the_sdk_sees_a_refusal_as_a_bad_request(pd: Cluster) -> None:
    with pytest.raises(openai.BadRequestError, match="conversation objects"):
        await pd.openai().responses.create(model=MODEL_NAME, input="hi", conversation="conv_1")


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1"),
     ("POST", "/v1/responses/resp_1/cancel"), ("GET", "/v1/responses/resp_1?stream=true")],
)  # fmt: skip
async def test_unknown_responses_are_404s(pd: Cluster, method: str, path: str) -> None:
    async with pd.http() as http:
        response = await http.request(method, path)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "request_not_found"
    with pytest.raises(openai.NotFoundError, match="no response with id"):
        await pd.openai().responses.retrieve("resp_1")


async def test_truncation_auto_drops_the_oldest_turns_until_the_prompt_fits(pd: Cluster) -> None:
    turns: list[dict[str, Any]] = []
    for index in range(5):
        turns.append({"role": "user", "content": f"question {index} " + "q" * 40})
        turns.append({"role": "assistant", "content": f"answer {index} " + "a" * 40})
    turns.append({"role": "user", "content": "last question"})
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "instructions": "Be brief.",
        "input": turns,
        "max_output_tokens": 20,
    }
    client = pd.openai()
    with pytest.raises(openai.BadRequestError):
        await client.responses.create(**body)  # 535 prompt tokens: too long for 256
    response = await client.responses.create(**body, truncation="auto")
    assert response.truncation == "auto" and response.output_text

    def rendered(kept: list[dict[str, Any]]) -> list[int]:
        # NOTE: the fakes' template: <|role|>content per message, then <|assistant|>.
        ids = [257, *b"Be brief."]
        for message in kept:
            ids += [258 if message["role"] == "user" else 259, *message["content"].encode()]
        return [*ids, 259]

    sent = list(pd.prefills[0].requests[-1].token_ids)
    # NOTE: the fewest turns dropped: one more kept would not leave max_output_tokens.
    assert sent == rendered(turns[6:])
    assert len(sent) + 20 <= 256 < len(rendered(turns[4:])) + 20
