"""Reasoning on the Responses API, as the openai SDK reads it: what the reasoning parser reads
out of a completion (gpt-oss's analysis channel, DeepSeek's think block) is a ``reasoning``
output item before the message or the calls, streamed as ``response.reasoning_text.delta``."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types import responses as sdk
from support.family_chat import DEEPSEEK, GPT_OSS, FamilyModel
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME

MAX_MODEL_LEN = 4096
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Simple greeting.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the tool.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
DEEPSEEK_CALL = (
    "Weather means the tool.</think>\n\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


async def _start(cluster: Cluster, family: FamilyModel, script: str) -> None:
    await cluster.start_gateway()
    # NOTE: the family's model before it registers: the gateway reads it then.
    await cluster.add_prefill(max_model_len=MAX_MODEL_LEN, setup=family.use)
    await cluster.add_decode(max_model_len=MAX_MODEL_LEN)
    family.script(cluster, script)


def _summary(output: list[Any]) -> list[tuple[str, str]]:
    """(type, text or call) of each output item."""
    summary = []
    for item in output:
        if isinstance(item, sdk.ResponseReasoningItem):
            assert item.summary == [] and item.id.startswith("rs_")
            summary.append(("reasoning", "".join(c.text for c in item.content or [])))
        elif isinstance(item, sdk.ResponseOutputMessage):
            text = "".join(c.text for c in item.content if isinstance(c, sdk.ResponseOutputText))
            summary.append(("message", text))
        else:
            assert isinstance(item, sdk.ResponseFunctionToolCall)
            summary.append(("function_call", f"{item.name} {item.arguments}"))
    return summary


@pytest.mark.parametrize(
    ("family", "script", "tools", "expected"),
    [
        (
            GPT_OSS,
            HARMONY_ANSWER,
            [],
            [("reasoning", "Simple greeting."), ("message", "Hello there!")],
        ),
        (
            GPT_OSS,
            HARMONY_CALL,
            TOOLS,
            [("reasoning", "Need the tool."), ("function_call", 'get_weather {"city": "Paris"}')],
        ),
        (
            DEEPSEEK,
            DEEPSEEK_CALL,
            TOOLS,
            [
                ("reasoning", "Weather means the tool."),
                ("function_call", 'get_weather {"city": "Paris"}'),
            ],
        ),
    ],
    ids=["gpt_oss_answer", "gpt_oss_call", "deepseek_call"],
)
async def test_reasoning_is_an_output_item_whole_and_streamed(
    cluster: Cluster,
    family: FamilyModel,
    script: str,
    tools: list[Any],
    expected: list[tuple[str, str]],
) -> None:
    await _start(cluster, family, script)
    client = cluster.openai()
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    response = await client.responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=400, **extra
    )
    assert response.status == "completed"
    assert _summary(response.output) == expected

    stream = await client.responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=400, stream=True, **extra
    )
    events = [event async for event in stream]
    deltas = [e for e in events if isinstance(e, sdk.ResponseReasoningTextDeltaEvent)]
    assert "".join(e.delta for e in deltas) == expected[0][1]
    assert len(deltas) > 1  # streamed as the model writes it, not in one piece
    [done] = [e for e in events if isinstance(e, sdk.ResponseReasoningTextDoneEvent)]
    assert (done.text, done.output_index, done.item_id) == (expected[0][1], 0, deltas[0].item_id)
    types = [e.type for e in events]
    assert types[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
    ]
    assert types.index("response.reasoning_text.done") < types.index("response.output_item.done")
    completed = events[-1]
    assert isinstance(completed, sdk.ResponseCompletedEvent)
    assert _summary(completed.response.output) == expected


async def test_a_model_without_reasoning_has_no_reasoning_item(cluster: Cluster) -> None:
    await cluster.start_gateway()
    await cluster.add_prefill()
    await cluster.add_decode()
    cluster.script("Plain answer.")
    response = await cluster.openai().responses.create(model=MODEL_NAME, input="Hi")
    assert [item.type for item in response.output] == ["message"]


async def test_an_earlier_responses_output_goes_back_as_input_reasoning_included(
    cluster: Cluster,
) -> None:
    """A stateless client sends a response's output (its reasoning item too) back with the
    call's result, as the openai SDK's examples do."""
    await _start(cluster, GPT_OSS, HARMONY_CALL)
    client = cluster.openai()
    first = await client.responses.create(
        model=MODEL_NAME, input="Weather in Paris?", max_output_tokens=400, tools=TOOLS
    )
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert isinstance(call, sdk.ResponseFunctionToolCall)
    items: list[Any] = [
        {"role": "user", "content": "Weather in Paris?"},
        *first.output,  # NOTE: the SDK's own objects, as its examples pass them
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    GPT_OSS.script(cluster, HARMONY_ANSWER)
    second = await client.responses.create(
        model=MODEL_NAME, input=items, max_output_tokens=400, tools=TOOLS
    )
    assert second.status == "completed"
    assert _summary(second.output) == [
        ("reasoning", "Simple greeting."),
        ("message", "Hello there!"),
    ]
