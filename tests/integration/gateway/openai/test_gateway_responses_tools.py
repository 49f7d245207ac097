"""Function tools on the Responses API (``POST /v1/responses``), through the openai SDK against
fake instances whose completion is a script: ``function_call`` output items and their events
(each validated by the SDK's own models), history items rendered as the chat path renders the
same conversation, and the constraints a forced ``tool_choice`` sends, the chat path's."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import responses as sdk
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME
from support.responses_events import SDK_EVENTS

MAX_MODEL_LEN = 2048  # the fallback's tool instruction is long in a byte-level tokenizer
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": WEATHER_PARAMETERS,
        "strict": False,
    },
    {"type": "function", "name": "get_time", "parameters": {"type": "object"}, "strict": False},
]
CHAT_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER_PARAMETERS,
            "strict": False,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object"}, "strict": False},
    },
]
QUESTION = "Weather in Zürich?"
ARGUMENTS = '{"city": "Zürich", "days": 2}'
HERMES_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n</tool_call>'
TIME_CALL = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


@pytest.fixture
async def tools(cluster: Cluster) -> Cluster:
    """A gateway with one prefill and one decode whose model length fits tool prompts."""
    await cluster.start_gateway()
    await cluster.add_prefill(max_model_len=MAX_MODEL_LEN)
    await cluster.add_decode(max_model_len=MAX_MODEL_LEN)
    return cluster


def _collapsed(types: list[str]) -> list[str]:
    """Event types with runs of the same type as one."""
    return [t for i, t in enumerate(types) if not (i and t == types[i - 1])]


async def _post(cluster: Cluster, body: dict[str, Any]) -> dict[str, Any]:
    async with cluster.http() as http:
        response = await http.post("/v1/responses", json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    whole: dict[str, Any] = response.json()
    sdk.Response.model_validate(whole)  # the SDK builds without validating: check every field
    return whole


async def _events(cluster: Cluster, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's events, each checked against its SDK model and its ``event:`` line."""
    body = {"model": MODEL_NAME, **body, "stream": True}
    async with (
        cluster.http() as http,
        http.stream("POST", "/v1/responses", json=body) as response,
    ):
        assert response.status_code == 200
        raw = "".join([part async for part in response.aiter_text()])
    events = []
    for event in raw.split("\n\n")[:-1]:
        name, data = event.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        SDK_EVENTS[payload["type"]].model_validate(payload)
        events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


async def test_text_then_a_call_are_a_message_and_a_function_call(tools: Cluster) -> None:
    tools.script(f"Let me check.\n{HERMES_CALL}")
    whole = await _post(tools, {"input": QUESTION, "tools": TOOLS, "max_output_tokens": 200})
    assert whole["status"] == "completed" and whole["incomplete_details"] is None
    message, call = whole["output"]
    assert message["type"] == "message" and message["status"] == "completed"
    assert message["content"][0]["text"] == "Let me check."
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["call_id"].startswith("call_") and len(call["call_id"]) == 29
    assert call["id"] == "fc_" + call["call_id"].removeprefix("call_")
    assert (call["name"], call["arguments"]) == ("get_weather", ARGUMENTS)
    assert whole["tools"] == [{"description": None, **tool} for tool in TOOLS]
    assert (whole["tool_choice"], whole["parallel_tool_calls"]) == ("auto", True)
    assert tools.sent_constraint() is None


async def test_streamed_calls_are_items_whose_arguments_arrive_in_pieces(tools: Cluster) -> None:
    tools.script(f"Checking.\n{HERMES_CALL}\n{TIME_CALL}")
    body = {"input": QUESTION, "tools": TOOLS, "max_output_tokens": 300}
    whole = await _post(tools, body)
    events = await _events(tools, body)
    message_events = [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    call_events = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert _collapsed([e["type"] for e in events]) == [
        "response.created",
        "response.in_progress",
        *message_events,
        *call_events,
        *call_events,
        "response.completed",
    ]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "message"),
        (1, "function_call"),
        (2, "function_call"),
    ]
    assert [e["item"].get("name") for e in added[1:]] == ["get_weather", "get_time"]
    assert all(e["item"]["status"] == "in_progress" for e in added)
    for index, arguments in [(1, ARGUMENTS), (2, "{}")]:
        item_id = added[index]["item"]["id"]
        pieces = [
            e["delta"]
            for e in events
            if e["type"] == "response.function_call_arguments.delta" and e["item_id"] == item_id
        ]
        assert "".join(pieces) == arguments
        [done] = [
            e
            for e in events
            if e["type"] == "response.function_call_arguments.done" and e["item_id"] == item_id
        ]
        assert (done["output_index"], done["arguments"]) == (index, arguments)
    # NOTE: the arguments arrive as the model writes them, not in one last event.
    assert len([e for e in events if e["type"] == "response.function_call_arguments.delta"]) > 5
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    assert all(i["status"] == "completed" for i in final["output"])
    assert final["output"][0]["content"][0]["text"] == "Checking."
    # the same items as the non-streamed response (ids of calls are new in each)
    for streamed, item in zip(final["output"][1:], whole["output"][1:], strict=True):
        assert (streamed["name"], streamed["arguments"]) == (item["name"], item["arguments"])


async def test_the_stream_helper_assembles_the_call(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    async with tools.openai().responses.stream(
        model=MODEL_NAME, input=QUESTION, tools=TOOLS, max_output_tokens=200
    ) as stream:
        deltas = [
            e.delta async for e in stream if e.type == "response.function_call_arguments.delta"
        ]
        final = await stream.get_final_response()
    assert final.status == "completed"
    [call] = final.output
    assert call.type == "function_call"
    assert (call.name, call.arguments) == ("get_weather", ARGUMENTS) == (call.name, "".join(deltas))


async def test_tool_choice_none_leaves_the_text_a_message(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    whole = await _post(
        tools, {"input": QUESTION, "tools": TOOLS, "tool_choice": "none", "max_output_tokens": 200}
    )
    [message] = whole["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == HERMES_CALL
    assert tools.sent_constraint() is None


async def test_a_call_cut_by_max_output_tokens_is_incomplete(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    whole = await _post(tools, {"input": QUESTION, "tools": TOOLS, "max_output_tokens": 50})
    assert whole["status"] == "incomplete"
    [call] = whole["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete"
    assert ARGUMENTS.startswith(call["arguments"]) and call["arguments"] != ARGUMENTS


@pytest.mark.parametrize(
    ("tool_choice", "chat_choice", "script"),
    [
        ("required", "required", f'[{{"name": "get_weather", "arguments": {ARGUMENTS}}}]'),
        (
            {"type": "function", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
            ARGUMENTS,
        ),
    ],
    ids=["required", "named"],
)
@pytest.mark.parametrize("is_parallel", [True, False])
async def test_a_forced_call_sends_the_chat_paths_constraint(
    tools: Cluster, tool_choice: Any, chat_choice: Any, script: str, is_parallel: bool
) -> None:
    tools.script(script)
    whole = await _post(
        tools,
        {
            "input": QUESTION,
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "parallel_tool_calls": is_parallel,
            "max_output_tokens": 200,
        },
    )
    constraint = tools.sent_constraint()
    await tools.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        tools=CHAT_TOOLS,
        tool_choice=chat_choice,
        parallel_tool_calls=is_parallel,
        max_tokens=200,
    )
    assert constraint is not None and constraint == tools.sent_constraint()
    assert whole["status"] == "completed"
    [call] = whole["output"]
    assert (call["type"], call["name"], call["arguments"]) == (
        "function_call",
        "get_weather",
        ARGUMENTS,
    )
    assert (whole["tool_choice"], whole["parallel_tool_calls"]) == (tool_choice, is_parallel)


async def test_call_items_render_as_the_same_chat_history(tools: Cluster) -> None:
    tools.script("It is sunny.")
    items: list[Any] = [
        {"role": "user", "content": "Weather and time in Zürich?"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking both.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": ARGUMENTS, "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "noon"}]},
    ]  # fmt: skip
    whole = await _post(tools, {"input": items, "tools": TOOLS, "max_output_tokens": 50})
    prompt_ids = list(tools.prefills[0].requests[-1].token_ids)
    calls: list[Any] = [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": ARGUMENTS}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]  # fmt: skip
    await tools.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=[
            {"role": "user", "content": "Weather and time in Zürich?"},
            {"role": "assistant", "content": "Checking both.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        ],
        tools=CHAT_TOOLS,
        max_tokens=50,
    )
    assert prompt_ids == list(tools.prefills[0].requests[-1].token_ids)
    prompt = bytes(t for t in prompt_ids if t < 256).decode()
    # NOTE: one assistant message: its text, then both calls (the fallback's hermes format).
    assert (
        f'Checking both.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    ) in prompt
    assert "<|tool|>sunny, 21 C" in prompt and "<|tool|>noon" in prompt
    assert whole["output"][0]["content"][0]["text"] == "It is sunny."


async def test_a_client_sends_the_call_back_with_its_output(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    client = tools.openai()
    first = await client.responses.create(
        model=MODEL_NAME, input=QUESTION, tools=TOOLS, max_output_tokens=200
    )
    [call] = first.output
    assert call.type == "function_call"
    tools.script("Cloudy.")
    answer = await client.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "user", "content": QUESTION},
            *first.output,  # the SDK's own objects, as clients send them
            {"type": "function_call_output", "call_id": call.call_id, "output": "cloudy"},
        ],
        tools=TOOLS,
        max_output_tokens=20,
    )
    assert answer.output_text == "Cloudy."
    prompt = bytes(t for t in tools.prefills[0].requests[-1].token_ids if t < 256).decode()
    assert f'"arguments": {ARGUMENTS}}}\n</tool_call><|tool|>cloudy' in prompt


async def test_text_after_a_call_is_a_message_of_its_own(tools: Cluster) -> None:
    tools.script(f"{HERMES_CALL}\nDone.")
    body = {"input": QUESTION, "tools": TOOLS, "max_output_tokens": 200}
    whole = await _post(tools, body)
    events = await _events(tools, body)
    for output in (whole["output"], events[-1]["response"]["output"]):
        assert [item["type"] for item in output] == ["function_call", "message"]
        assert output[1]["content"][0]["text"] == "Done."
        assert output[1]["id"].startswith("msg_")
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [0, 1]
