"""Tool calling with SmolLM2-135M-Instruct, the default model, through gateway, prefill and
decode processes, with the openai SDK and the gRPC stub.

SmolLM2's chat template renders neither tools nor tool calls, so the gateway writes them in the
hermes format (the ``auto`` parser's choice for it); the reference is transformers rendering the
same messages with the same template and generating greedily from the same GGUF. Given a
history with a call and its result, the model writes a call again, in ``<tool_call>`` tags:
the gateway reads it out of the text.

A forced tool_choice (``required``, a named function) is a constraint the engine applies: a
request that asks for no tool still gets a valid call, token for token what the engine's mask
makes of transformers' logits.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from support.hf_reference import chat_greedy
from support.masked_reference import masked_greedy
from support.process_cluster import ProcessCluster

from pdserve.common.grpc_server import insecure_channel
from pdserve.engine.model_store import DEFAULT_MODEL, ResolvedModel
from pdserve.gateway.prepare.params import ChatMessage
from pdserve.gateway.prepare.tool_prompt import template_inputs
from pdserve.gateway.tools.formats import FORMATS, HERMES
from pdserve.gateway.tools.plan import forced_call_constraint
from pdserve.gateway.tools.spec import FunctionTool, ToolCall, ToolChoice, ToolChoiceMode
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

MAX_TOKENS = 48
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city name"}},
    "required": ["city"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": WEATHER_PARAMETERS,
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
HISTORY: list[Any] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
]


@pytest.fixture(scope="module")
def cluster(smollm2_processes: ProcessCluster) -> ProcessCluster:
    return smollm2_processes  # NOTE: shared with the other files that only send it requests


def _template_messages(smollm2: ResolvedModel) -> list[dict[str, Any]]:
    """HISTORY as SmolLM2's template gets it (tools and the call in the hermes format)."""
    tokenizer = Tokenizer.from_pretrained(smollm2.path)
    conversation = (
        ChatMessage("user", HISTORY[0]["content"]),
        ChatMessage(
            "assistant", None, tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)
        ),
        ChatMessage("tool", HISTORY[2]["content"], tool_call_id="call_1"),
    )
    weather = FunctionTool(
        "get_weather", TOOLS[0]["function"]["description"], json.dumps(WEATHER_PARAMETERS)
    )
    messages, tools = template_inputs(
        conversation, (weather,), FORMATS[HERMES], tokenizer.tool_support
    )
    assert tools is None  # SmolLM2's template renders no tools
    return messages


def _reference(smollm2_reference: tuple[Any, Any], messages: list[dict[str, Any]]) -> tuple:
    """(prompt ids, greedy completion ids up to <|im_end|>, its text) from transformers."""
    prompt_ids, generated = chat_greedy(smollm2_reference, messages, MAX_TOKENS)
    tokenizer = smollm2_reference[0]
    return prompt_ids, generated, tokenizer.decode(generated, skip_special_tokens=True)


async def test_a_tool_conversation_is_rendered_as_transformers_and_its_call_read(
    cluster: ProcessCluster, smollm2: ResolvedModel, smollm2_reference: tuple[Any, Any]
) -> None:
    prompt_ids, expected, text = _reference(smollm2_reference, _template_messages(smollm2))
    assert text.startswith("<tool_call>")  # what the model writes after such a history
    response = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=HISTORY,
        tools=TOOLS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    extra = choice.model_extra or {}
    assert extra["prompt_token_ids"] == prompt_ids
    assert extra["token_ids"] == expected
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


async def test_streamed_tool_call_deltas_are_shaped_as_openai(cluster: ProcessCluster) -> None:
    stream = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=HISTORY,
        tools=TOOLS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].delta.role == "assistant"
    assert not "".join(c.delta.content or "" for c in choices)  # no markup leaks
    steps = [step for c in choices for step in c.delta.tool_calls or ()]
    first, *rest = steps
    assert (first.index, first.type) == (0, "function")
    assert first.id is not None and first.id.startswith("call_")
    assert first.function is not None and first.function.name == "get_weather"
    # NOTE: how many deltas follow depends on how the tokens reached the gateway: beside a CPU
    # hog the whole call once came in one piece. That the arguments stream as they are written
    # is `test_arguments_stream_while_the_call_is_written`'s (tools/test_gateway_tool_parsers).
    assert all(s.id is None and s.index == 0 for s in rest)
    arguments = "".join(s.function.arguments or "" for s in steps if s.function)
    assert json.loads(arguments) == {"city": "Paris"}
    assert [c.finish_reason for c in choices if c.finish_reason] == ["tool_calls"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


async def test_grpc_carries_tools_and_the_call(cluster: ProcessCluster) -> None:
    call = generation_pb2.ToolCall(
        id="call_1",
        function=generation_pb2.FunctionCall(name="get_weather", arguments='{"city": "Paris"}'),
    )
    request = generation_pb2.GenerateRequest(
        model=DEFAULT_MODEL,
        chat=generation_pb2.ChatMessages(
            messages=[
                generation_pb2.ChatMessage(role="user", content=HISTORY[0]["content"]),
                generation_pb2.ChatMessage(role="assistant", tool_calls=[call]),
                generation_pb2.ChatMessage(
                    role="tool", tool_call_id="call_1", content=HISTORY[2]["content"]
                ),
            ]
        ),
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        tools=[
            generation_pb2.Tool(
                function=generation_pb2.FunctionDefinition(
                    name="get_weather",
                    description=TOOLS[0]["function"]["description"],
                    parameters=json.dumps(WEATHER_PARAMETERS),
                )
            )
        ],
    )
    async with insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        responses = [r async for r in stub.Generate(request)]
    steps = [step for r in responses for step in r.tool_calls]
    assert [(s.index, s.name) for s in steps if s.id] == [(0, "get_weather")]
    assert json.loads("".join(s.arguments for s in steps)) == {"city": "Paris"}
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
async def test_a_forced_tool_choice_makes_even_a_small_model_call(
    cluster: ProcessCluster, smollm2_reference: tuple[Any, Any], tool_choice: Any
) -> None:
    max_tokens = 64
    response = await cluster.openai().chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "Tell me a joke."}],
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = response.choices[0]
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    # NOTE: token for token what the engine's mask makes of transformers' logits.
    weather = FunctionTool(
        "get_weather", TOOLS[0]["function"]["description"], json.dumps(WEATHER_PARAMETERS)
    )
    named = isinstance(tool_choice, dict)
    forced = ToolChoice(ToolChoiceMode.FUNCTION, "get_weather") if named else None
    constraint = forced_call_constraint(
        (weather,), forced or ToolChoice(ToolChoiceMode.REQUIRED), True
    )
    assert constraint is not None
    extra = choice.model_extra or {}
    expected = masked_greedy(smollm2_reference, extra["prompt_token_ids"], constraint, max_tokens)
    generated = extra["token_ids"]
    assert generated == expected[: len(generated)]
    assert len(generated) >= len(expected) - 1  # the reference keeps its end id
