"""Tool calling through the gateway, with the openai SDK and the gRPC stub, against fake
instances whose completion is a script (the fake tokenizer's token ids are bytes)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import openai
import pytest
import structlog
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME

from pdserve.common.errors import from_rpc_error
from pdserve.common.grpc_server import insecure_channel
from pdserve.gateway.tools.plan import LAYOUT, calls_schema
from pdserve.gateway.tools.spec import FunctionTool
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

MAX_MODEL_LEN = 2048  # the fallback's tool instruction is long in a byte-level tokenizer
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
QUESTION: list[Any] = [{"role": "user", "content": "Weather in Zürich?"}]
ARGUMENTS = '{"city": "Zürich", "days": 2}'
HERMES_CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n</tool_call>'


@pytest.fixture
async def tools(cluster: Cluster) -> Cluster:
    """A gateway with one prefill and one decode whose model length fits tool prompts."""
    await cluster.start_gateway()
    await cluster.add_prefill(max_model_len=MAX_MODEL_LEN)
    await cluster.add_decode(max_model_len=MAX_MODEL_LEN)
    return cluster


async def test_auto_reads_a_hermes_call_out_of_the_text(tools: Cluster) -> None:
    tools.script(f"Let me check.\n{HERMES_CALL}")
    response = await tools.openai().chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, max_tokens=200
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls or []
    assert call.type == "function"
    assert call.id.startswith("call_") and len(call.id) == 29
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Zürich", "days": 2}
    assert tools.sent_constraint() is None


@pytest.mark.parametrize("is_stream", [False, True])
async def test_the_log_says_tool_calls_as_the_client_sees_it(
    tools: Cluster, is_stream: bool
) -> None:
    client = tools.openai()
    with structlog.testing.capture_logs() as logs:
        tools.script(f"Let me check.\n{HERMES_CALL}")
        called = await client.chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, tools=TOOLS, max_tokens=200, stream=is_stream
        )
        reasons = (
            [c.choices[0].finish_reason async for c in called if c.choices]
            if is_stream
            else [called.choices[0].finish_reason]
        )
        tools.script("Sunny.")
        await client.chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, tools=TOOLS, max_tokens=200
        )
    assert reasons[-1] == "tool_calls"
    finished = [record for record in logs if record["event"] == "request_finished"]
    assert [record["finish_reason"] for record in finished] == ["tool_calls", "stop"]


async def test_streamed_calls_are_shaped_as_openai_streams_them(tools: Cluster) -> None:
    second = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    tools.script(f"{HERMES_CALL}\n{second}")
    stream = await tools.openai().chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, max_tokens=300, stream=True
    )
    chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta for c in chunks]
    steps = [call for d in deltas for call in d.tool_calls or ()]
    assert not "".join(d.content or "" for d in deltas)  # no markup leaks into content
    firsts = [s for s in steps if s.id is not None]
    assert [(s.index, s.type, s.function and s.function.name) for s in firsts] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    later = [s for s in steps if s.id is None]
    assert later and all(s.type is None and s.function.name is None for s in later)  # type: ignore[union-attr]
    for index, expected in enumerate([ARGUMENTS, "{}"]):
        pieces = [s.function.arguments for s in steps if s.index == index]  # type: ignore[union-attr]
        assert "".join(pieces) == expected  # type: ignore[arg-type]
    # NOTE: the arguments arrive in pieces as the model writes them, not in one last chunk.
    assert len([s for s in steps if s.index == 0]) > 5
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_a_stream_sends_no_empty_chunks_yet_every_token_id(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    for return_token_ids in (False, True):
        stream = await tools.openai().chat.completions.create(
            model=MODEL_NAME,
            messages=QUESTION,
            tools=TOOLS,
            max_tokens=200,
            stream=True,
            extra_body={"return_token_ids": return_token_ids},
        )
        chunks = [chunk async for chunk in stream]
        if return_token_ids:
            token_ids = [t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]]
            assert bytes(t for t in token_ids if t < 256) == HERMES_CALL.encode()
        else:
            # NOTE: the tokens of the call's markup are not sent as empty deltas.
            choices = [c.choices[0] for c in chunks[1:-1]]
            assert all(c.delta.tool_calls for c in choices)


async def test_tokenize_renders_tools_as_a_chat_request(tools: Cluster) -> None:
    tools.script("ok")
    async with tools.http() as http:
        tokenized = await http.post(
            "/tokenize", json={"model": MODEL_NAME, "messages": QUESTION, "tools": TOOLS}
        )
    response = await tools.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=4,
        extra_body={"return_token_ids": True},
    )
    prompt_ids = (response.choices[0].model_extra or {})["prompt_token_ids"]
    assert tokenized.status_code == 200
    assert tokenized.json()["tokens"] == prompt_ids
    assert b"<tools>" in bytes(t for t in prompt_ids if t < 256)


async def test_the_sdk_stream_helper_assembles_the_calls(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    async with tools.openai().chat.completions.stream(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, max_tokens=200
    ) as stream:
        final = await stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS)
    assert final.choices[0].finish_reason == "tool_calls"


async def test_a_call_of_a_function_not_offered_stays_text(tools: Cluster) -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    tools.script(text)
    response = await tools.openai().chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, max_tokens=100
    )
    choice = response.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (text, None)
    assert choice.finish_reason == "stop"


async def test_tool_choice_none_leaves_the_text_alone(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    response = await tools.openai().chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=200
    )
    choice = response.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (HERMES_CALL, None)
    assert choice.finish_reason == "stop"
    assert tools.sent_constraint() is None


@pytest.mark.parametrize("is_parallel", [True, False])
async def test_required_sends_the_calls_schema_and_reads_its_list(
    tools: Cluster, is_parallel: bool
) -> None:
    calls = f'[{{"name": "get_weather", "arguments": {ARGUMENTS}}}]'
    tools.script(calls)
    response = await tools.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=is_parallel,
        max_tokens=200,
    )
    constraint = tools.sent_constraint()
    assert constraint is not None and constraint.WhichOneof("kind") == "json_schema"
    offered = (
        FunctionTool("get_weather", parameters=json.dumps(WEATHER_PARAMETERS)),
        FunctionTool("get_time", parameters=json.dumps({"type": "object"})),
    )
    schema = json.loads(constraint.json_schema)
    assert schema.pop("x-guidance") == LAYOUT
    assert schema == calls_schema(offered, is_parallel)
    assert ("maxItems" in schema) is not is_parallel
    choice = response.choices[0]
    [call] = choice.message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS)
    assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")


async def test_a_named_function_sends_its_parameters_schema(tools: Cluster) -> None:
    tools.script(ARGUMENTS)
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    response = await tools.openai().chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, tool_choice=named, max_tokens=200
    )
    constraint = tools.sent_constraint()
    assert constraint is not None
    assert json.loads(constraint.json_schema) == {"x-guidance": LAYOUT, **WEATHER_PARAMETERS}
    choice = response.choices[0]
    [call] = choice.message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGUMENTS)
    # NOTE: as OpenAI: a named tool_choice ends with "stop".
    assert choice.finish_reason == "stop"


async def test_history_with_calls_and_results_reaches_the_prompt(tools: Cluster) -> None:
    tools.script("It is sunny.")
    history: list[Any] = [
        *QUESTION,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ARGUMENTS},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    response = await tools.openai().chat.completions.create(
        model=MODEL_NAME,
        messages=history,
        tools=TOOLS,
        max_tokens=50,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    assert (choice.message.content, choice.finish_reason) == ("It is sunny.", "stop")
    prompt_ids = (choice.model_extra or {})["prompt_token_ids"]
    prompt = bytes(t for t in prompt_ids if t < 256).decode()
    # NOTE: the fake template renders neither tools nor calls: the fallback writes them in the
    # hermes format. It renders any role, the tool message's too.
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGUMENTS}}}\n' in prompt
    assert "<|tool|>sunny, 21 C" in prompt


async def test_n_choices_read_their_calls_each(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    response = await tools.openai().chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, n=2, max_tokens=200
    )
    assert [c.finish_reason for c in response.choices] == ["tool_calls", "tool_calls"]
    ids = {c.message.tool_calls[0].id for c in response.choices}  # type: ignore[index]
    assert len(ids) == 2


async def test_length_cut_keeps_the_partial_call_and_says_length(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    response = await tools.openai().chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, max_tokens=50
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert ARGUMENTS.startswith(call.function.arguments)


def _grpc_tools() -> list[generation_pb2.Tool]:
    return [
        generation_pb2.Tool(
            function=generation_pb2.FunctionDefinition(
                name=tool["function"]["name"],
                description=tool["function"].get("description", ""),
                parameters=json.dumps(tool["function"]["parameters"]),
            )
        )
        for tool in TOOLS
    ]


async def test_grpc_carries_tools_history_and_calls(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    call = generation_pb2.ToolCall(
        id="call_1", function=generation_pb2.FunctionCall(name="get_time", arguments="{}")
    )
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME,
        chat=generation_pb2.ChatMessages(
            messages=[
                generation_pb2.ChatMessage(role="user", content="Time, then weather?"),
                generation_pb2.ChatMessage(role="assistant", tool_calls=[call]),
                generation_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="noon"),
            ]
        ),
        sampling=common_pb2.SamplingParams(max_tokens=200),
        tools=_grpc_tools(),
        tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED),
        parallel_tool_calls=False,
        include_prompt_token_ids=True,
    )
    async with insecure_channel(tools.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        responses = [r async for r in stub.Generate(request)]
    steps = [step for r in responses for step in r.tool_calls]
    assert [(s.index, s.name) for s in steps if s.id] == [(0, "get_weather")]
    assert steps[0].id.startswith("call_")
    assert "".join(s.arguments for s in steps) == ARGUMENTS
    assert "".join(r.text for r in responses) == ""
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    constraint = tools.sent_constraint()
    assert constraint is not None
    assert json.loads(constraint.json_schema)["maxItems"] == 1
    prompt = bytes(t for t in responses[0].prompt_token_ids if t < 256).decode()
    assert '{"name": "get_time", "arguments": {}}' in prompt
    assert "<|tool|>noon" in prompt


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([generation_pb2.ChatMessage(role="tool", content="noon")], "messages[0].tool_call_id"),
        (
            [generation_pb2.ChatMessage(role="user", tool_calls=[generation_pb2.ToolCall(id="c")])],
            "messages[0].tool_calls",
        ),
        (
            [generation_pb2.ChatMessage(role="tool", tool_call_id="nobody", content="x")],
            "messages[0].tool_call_id",
        ),
    ],
)
async def test_grpc_refuses_messages_by_role(
    tools: Cluster, messages: list[generation_pb2.ChatMessage], param: str
) -> None:
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME,
        chat=generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="user", content="hi"), *messages]
        ),
        sampling=common_pb2.SamplingParams(max_tokens=4),
    )
    param = param.replace("[0]", "[1]")
    async with insecure_channel(tools.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in stub.Generate(request)]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(caught.value).metadata["param"] == param
    assert tools.prefills[0].requests == []


async def test_an_assistant_message_with_calls_needs_no_content(tools: Cluster) -> None:
    tools.script("ok")
    history: list[Any] = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "x", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "done"},
    ]
    response = await tools.openai().chat.completions.create(
        model=MODEL_NAME, messages=history, max_tokens=8
    )
    assert response.choices[0].message.content == "ok"


async def test_a_user_message_without_content_is_refused(tools: Cluster) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await tools.openai().chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user"}],  # type: ignore[list-item, typeddict-item]
            max_tokens=8,
        )
    assert caught.value.param == "messages[0].content"  # type: ignore[attr-defined]
    assert tools.prefills[0].requests == []


async def test_a_client_sends_the_answer_back_with_the_result(tools: Cluster) -> None:
    tools.script(HERMES_CALL)
    client = tools.openai()
    first = await client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=TOOLS, max_tokens=200
    )
    message = first.choices[0].message
    [call] = message.tool_calls or []
    tools.script("Cloudy.")
    answer = await client.chat.completions.create(
        model=MODEL_NAME,
        messages=[
            *QUESTION,
            message,  # type: ignore[list-item]  # the SDK's own object, as clients send it
            {"role": "tool", "tool_call_id": call.id, "content": "cloudy"},
        ],
        tools=TOOLS,
        max_tokens=20,
    )
    assert answer.choices[0].message.content == "Cloudy."
    prompt = bytes(t for t in tools.prefills[0].requests[-1].token_ids if t < 256).decode()
    assert f'"arguments": {ARGUMENTS}}}\n</tool_call><|tool|>cloudy' in prompt
