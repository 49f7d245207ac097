"""The Responses API in front of real prefill and decode services, through the openai SDK.

A response holds the tokens the chat path and the single-process engine give the same
conversation (same seed), streamed or not; its events add up; ``max_output_tokens`` makes it
incomplete; refused parameters cost no work; ``text.format`` gives JSON of the format (on the
default model, an instruct model), which the SDK's ``parse`` and ``stream`` read into a pydantic
model; a forced ``tool_choice`` gives a ``function_call`` item whose arguments match the
function's parameters, and the turn with its output continues as the chat path's, sent whole
or by ``previous_response_id``; a conversation of turns that each name the one before is the
conversation sent whole. The reference engine runs in a worker thread: the services share
this event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from support.process_cluster import ProcessCluster
from support.real_cluster import MODEL_NAME, RealCluster, Reference

from pdserve.engine.model_store import DEFAULT_MODEL

INSTRUCTIONS = "You explain serving systems."
ITEMS: list[Any] = [
    {"role": "user", "content": [{"type": "input_text", "text": "What is PD disaggregation?"}]},
    {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
     "content": [{"type": "output_text", "text": "Prefill and decode apart.", "annotations": []}]},
    {"role": "developer", "content": "Answer in one sentence."},
    {"role": "user", "content": "Why?"},
]  # fmt: skip
MESSAGES = [
    {"role": "system", "content": INSTRUCTIONS},
    {"role": "user", "content": "What is PD disaggregation?"},
    {"role": "assistant", "content": "Prefill and decode apart."},
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "Why?"},
]
SAMPLING = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
SCHEMA = {
    "type": "object",
    "properties": {
        "first_stage": {"enum": ["prefill", "decode"]},
        "num_stages": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["first_stage", "num_stages"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city name"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "strict": True,
                "description": "Get the current weather in a city.",
                "parameters": WEATHER_PARAMETERS}  # fmt: skip
QUESTION = "Which stage of LLM serving comes first, and how many stages are there?"


class Pipeline(pydantic.BaseModel):
    """What the SDK's helpers parse the output into (it sends the model's strict schema)."""

    first_stage: Literal["prefill", "decode"]
    num_stages: int


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> Reference:
    return Reference(demo_model_dir)


@pytest.fixture
async def cluster(demo_model_dir: Path) -> AsyncIterator[RealCluster]:
    real = RealCluster(demo_model_dir)
    try:
        yield await real.start()
    finally:
        await real.close()


@pytest.fixture(scope="module")
def smollm2_cluster(smollm2_processes: ProcessCluster) -> ProcessCluster:
    """The default model (an instruct model, unlike the demo model) in gateway, prefill and
    decode processes, shared with the other files that only send it requests."""
    return smollm2_processes


def _request(max_output_tokens: int, **extra: Any) -> dict[str, Any]:
    """A Responses request of the conversation; the seed and the stop ids are extensions."""
    sampling = {"temperature": SAMPLING["temperature"], "top_p": SAMPLING["top_p"]}
    return {"model": MODEL_NAME, "instructions": INSTRUCTIONS, "input": ITEMS,
            "max_output_tokens": max_output_tokens, **sampling,
            "extra_body": {"seed": SAMPLING["seed"], **extra}}  # fmt: skip


async def test_a_seeded_response_equals_the_chat_path_and_the_engine(
    cluster: RealCluster, reference: Reference
) -> None:
    expected = await asyncio.to_thread(reference.chat, MESSAGES, **SAMPLING, max_tokens=24)
    client = cluster.openai()
    response = await client.responses.create(**_request(24))
    chat = await client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=24, **SAMPLING
    )
    assert response.output_text == chat.choices[0].message.content == reference.text(expected)
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.input_tokens == len(reference.tokenizer.encode_chat(MESSAGES))
    assert response.usage.output_tokens == len(expected)
    await cluster.assert_whole()


async def test_streamed_events_add_up_to_the_engines_text(
    cluster: RealCluster, reference: Reference
) -> None:
    expected = await asyncio.to_thread(reference.chat, MESSAGES, **SAMPLING, max_tokens=24)
    stream = await cluster.openai().responses.create(**_request(24), stream=True)
    events = [event async for event in stream]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert "".join(deltas) == last.response.output_text == reference.text(expected)
    await cluster.assert_whole()


async def test_the_stream_helper_completes_on_a_stop_and_is_incomplete_on_max_output_tokens(
    cluster: RealCluster, reference: Reference
) -> None:
    free = await asyncio.to_thread(reference.chat, MESSAGES, **SAMPLING, max_tokens=24)
    # NOTE: a token first generated at index 5 or later, as a stop id, ends the completion.
    stop_id = next(t for i, t in enumerate(free) if i >= 5 and t not in free[:i])
    expected = free[: free.index(stop_id) + 1]
    client = cluster.openai()
    async with client.responses.stream(**_request(24, stop_token_ids=[stop_id])) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert final.status == "completed" and final.incomplete_details is None
    # NOTE: the stop token ends the completion, counted but, as vLLM's, not in the text.
    assert "".join(deltas) == final.output_text == reference.text(expected[:-1])
    assert final.usage is not None and final.usage.output_tokens == len(expected)

    async with client.responses.stream(**_request(4)) as stream:
        events = [event async for event in stream]
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage is not None and last.response.usage.output_tokens == 4
    assert last.response.output_text == reference.text(free[:4])
    await cluster.assert_whole()


async def test_refused_parameters_are_400s_before_any_work(cluster: RealCluster) -> None:
    client = cluster.openai()
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        await client.responses.create(model=MODEL_NAME, input="hi", previous_response_id="r_1")
    with pytest.raises(openai.BadRequestError, match="'web_search'"):
        await client.responses.create(model=MODEL_NAME, input="hi", tools=[{"type": "web_search"}])
    status = await cluster.pool_status(cluster.decodes[0].address)
    assert status.pool.num_free_blocks == status.pool.num_total_blocks


@pytest.mark.slow
@pytest.mark.parametrize(
    "text_format",
    [{"type": "json_schema", "name": "pipeline", "schema": SCHEMA, "strict": True},
     {"type": "json_object"}],
    ids=["json_schema", "json_object"],
)  # fmt: skip
async def test_structured_output_is_json_that_matches_the_format(
    smollm2_cluster: ProcessCluster, text_format: dict[str, Any]
) -> None:
    response = await smollm2_cluster.openai().responses.create(
        model=DEFAULT_MODEL,
        instructions="Answer with JSON only.",
        input=QUESTION,
        max_output_tokens=96,
        temperature=0,
        text={"format": text_format},
    )
    assert response.status == "completed"
    value = json.loads(response.output_text)
    assert isinstance(value, dict)
    if text_format["type"] == "json_schema":
        jsonschema.validate(value, SCHEMA)


@pytest.mark.slow
async def test_the_sdk_parses_structured_output_into_a_model(
    smollm2_cluster: ProcessCluster,
) -> None:
    client = smollm2_cluster.openai()
    kwargs: dict[str, Any] = {"model": DEFAULT_MODEL, "input": QUESTION, "text_format": Pipeline,
                              "temperature": 0, "max_output_tokens": 64}  # fmt: skip
    parsed = await client.responses.parse(**kwargs)
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, Pipeline)
    async with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed
    assert "".join(deltas) == final.output_text == parsed.output_text


@pytest.mark.slow
async def test_a_forced_call_is_a_function_call_item_and_its_output_continues(
    smollm2_cluster: ProcessCluster,
) -> None:
    client = smollm2_cluster.openai()
    question = "What is the weather in Paris?"
    first = await client.responses.create(
        model=DEFAULT_MODEL,
        input=question,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=48,
        temperature=0,
    )
    assert first.status == "completed", first.output
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    result = "18 degrees and sunny"
    items: list[Any] = [
        {"role": "user", "content": question},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    answer = await client.responses.create(
        model=DEFAULT_MODEL,
        input=items,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        max_output_tokens=32,
        temperature=0,
    )
    # NOTE: the turn continues as the chat path continues the same conversation.
    chat_call = {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip
    messages: list[Any] = [
        {"role": "user", "content": question},
        {"role": "assistant", "tool_calls": [chat_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    function = {k: v for k, v in WEATHER_TOOL.items() if k != "type"}
    chat = await client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=messages,
        tools=[{"type": "function", "function": function}],  # type: ignore[list-item, typeddict-item]
        max_tokens=32,
        temperature=0,
    )
    assert answer.usage is not None and chat.usage is not None
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens > 0
    message = chat.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]  # type: ignore[union-attr]
    made = [(i.name, i.arguments) for i in answer.output if i.type == "function_call"]
    assert (answer.output_text, made) == (message.content or "", calls)
    # NOTE: the same turn by previous_response_id: the stored call keeps the id it was sent with.
    continued = await client.responses.create(
        model=DEFAULT_MODEL,
        input=items[2:],
        previous_response_id=first.id,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        max_output_tokens=32,
        temperature=0,
    )
    assert continued.usage is not None
    assert continued.usage.input_tokens == answer.usage.input_tokens
    assert continued.output_text == answer.output_text


async def test_a_conversation_goes_on_by_previous_response_id_as_if_sent_whole(
    smollm2_cluster: ProcessCluster,
) -> None:
    """Each turn names the one before it and sends only its new message: the prompt and the
    tokens are those of the whole conversation sent as items (greedy), every turn reads back
    as it was answered, and the last one lists the conversation as its input items."""
    client = smollm2_cluster.openai()
    settings: dict[str, Any] = {"model": DEFAULT_MODEL, "temperature": 0, "max_output_tokens": 12}
    questions = [QUESTION, "Say it in five words.", "Now in French."]
    whole: list[Any] = []
    previous: Any = None
    for question in questions:
        turn = await client.responses.create(
            input=question, previous_response_id=previous.id if previous else None, **settings
        )
        whole.append({"role": "user", "content": question})
        sent_whole = await client.responses.create(input=whole, store=False, **settings)
        assert turn.usage is not None and sent_whole.usage is not None
        assert turn.usage.input_tokens == sent_whole.usage.input_tokens
        assert turn.output_text == sent_whole.output_text
        assert turn.previous_response_id == (previous.id if previous else None)
        read = await client.responses.retrieve(turn.id)
        assert read.model_dump() == turn.model_dump()
        whole += [item.model_dump(exclude_none=True) for item in turn.output]
        previous = turn
    items = await client.responses.input_items.list(previous.id, order="asc", limit=100)
    assert [getattr(item, "role", None) for item in items.data] == [
        "user", "assistant", "user", "assistant", "user"
    ]  # fmt: skip


async def test_output_text_logprobs_equal_the_chat_paths(smollm2_cluster: ProcessCluster) -> None:
    """``include: ["message.output_text.logprobs"]`` gives the message's tokens with their
    logprobs and ``top_logprobs`` alternatives: those chat gives the same conversation, joined
    to the text; streamed, the delta events' entries add up to the part's; without the include
    there are none (``top_logprobs`` alone is only repeated)."""
    client = smollm2_cluster.openai()
    settings: dict[str, Any] = {"model": DEFAULT_MODEL, "temperature": 0, "max_output_tokens": 16}
    logprobs: dict[str, Any] = {"include": ["message.output_text.logprobs"], "top_logprobs": 3}
    response = await client.responses.create(input=QUESTION, **settings, **logprobs)
    chat = await client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=16, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    (message,) = response.output
    assert message.type == "message"
    part = message.content[0]
    assert part.type == "output_text" and part.logprobs
    expected = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert expected is not None
    assert part.text == chat.choices[0].message.content
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert [entry.token for entry in part.logprobs] == [entry.token for entry in expected]
    # NOTE: two runs may batch differently: equal to float noise.
    assert [entry.logprob for entry in part.logprobs] == pytest.approx(
        [entry.logprob for entry in expected], abs=1e-4
    )
    assert all(len(entry.top_logprobs) == 3 for entry in part.logprobs)
    assert response.top_logprobs == 3
    stream = await client.responses.create(input=QUESTION, stream=True, **settings, **logprobs)
    events = [event async for event in stream]
    streamed = [e for event in events if event.type == "response.output_text.delta"
                for e in event.logprobs]  # fmt: skip
    (done,) = [event for event in events if event.type == "response.output_text.done"]
    for entries in (streamed, done.logprobs):
        assert [entry.token for entry in entries] == [entry.token for entry in part.logprobs]
    plain = await client.responses.create(input=QUESTION, top_logprobs=2, **settings)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    assert plain.top_logprobs == 2 and plain.output_text == part.text
