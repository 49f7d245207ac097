"""Chat as each family's users expect, through the gateway with the openai SDK: a fake model
with gpt-oss's harmony tokens and template, and one with DeepSeek's, whose completions are
scripts in the family's own format (`support.family_chat`)."""

from __future__ import annotations

from typing import Any

import grpc
import openai
import pytest
from support.family_chat import DEEPSEEK, GPT_OSS, FamilyModel
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME

from pdserve.common.errors import from_rpc_error
from pdserve.common.grpc_server import insecure_channel
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

MAX_MODEL_LEN = 4096
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
QUESTION: list[Any] = [{"role": "user", "content": "Weather in Zürich?"}]
ARGUMENTS = '{"city": "Zürich"}'
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    f"<|message|>{ARGUMENTS}<|call|>"
)
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Simple greeting.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello there!<|return|>"
)
DEEPSEEK_CALL = (
    "The user wants the weather.\n</think>\n\nLet me check."
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    f"{ARGUMENTS}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)


async def _start(cluster: Cluster, family: FamilyModel) -> Cluster:
    await cluster.start_gateway()
    # NOTE: the family's model before it registers: the gateway reads it then.
    await cluster.add_prefill(max_model_len=MAX_MODEL_LEN, setup=family.use)
    await cluster.add_decode(max_model_len=MAX_MODEL_LEN)
    return cluster


async def _chat(cluster: Cluster, is_stream: bool, **body: Any) -> dict[str, Any]:
    """The message as the SDK reads it: whole, or its stream's deltas joined."""
    client = cluster.openai()
    if not is_stream:
        response = await client.chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, max_tokens=400, **body
        )
        choice = response.choices[0]
        message = choice.message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]  # type: ignore[union-attr]
        return {
            "content": message.content,
            "reasoning": getattr(message, "reasoning_content", None),
            "calls": calls,
            "finish_reason": choice.finish_reason,
        }
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, max_tokens=400, stream=True, **body
    )
    content, reasoning, names, arguments = "", "", {}, {}
    finish_reason = None
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for step in delta.tool_calls or []:
            if step.id is not None:
                names[step.index] = step.function.name  # type: ignore[union-attr]
            arguments[step.index] = arguments.get(step.index, "") + (
                step.function.arguments or ""  # type: ignore[union-attr]
            )
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return {
        "content": content or None,
        "reasoning": reasoning or None,
        "calls": [(names[i], arguments[i]) for i in sorted(names)],
        "finish_reason": finish_reason,
    }


@pytest.mark.parametrize("is_stream", [False, True])
async def test_gpt_oss_reasoning_and_a_harmony_call(cluster: Cluster, is_stream: bool) -> None:
    await _start(cluster, GPT_OSS)
    GPT_OSS.script(cluster, HARMONY_CALL)
    message = await _chat(cluster, is_stream, tools=TOOLS)
    assert message == {
        "content": None,
        "reasoning": "Need the weather tool.",
        "calls": [("get_weather", ARGUMENTS)],
        "finish_reason": "tool_calls",
    }
    # the prompt is the template's (tools included): it ends where the model's header starts
    prompt = GPT_OSS.decode(cluster.prefills[0].requests[-1].token_ids)
    assert "type get_weather = " in prompt
    assert prompt.endswith("<|start|>user<|message|>Weather in Zürich?<|end|><|start|>assistant")


@pytest.mark.parametrize("is_stream", [False, True])
async def test_gpt_oss_answer_without_tools(cluster: Cluster, is_stream: bool) -> None:
    await _start(cluster, GPT_OSS)
    GPT_OSS.script(cluster, HARMONY_ANSWER)
    message = await _chat(cluster, is_stream)
    assert message == {
        "content": "Hello there!",
        "reasoning": "Simple greeting.",
        "calls": [],
        "finish_reason": "stop",
    }


async def test_gpt_oss_hears_the_reasoning_effort_asked_for(cluster: Cluster) -> None:
    await _start(cluster, GPT_OSS)
    GPT_OSS.script(cluster, HARMONY_ANSWER)
    client = cluster.openai()
    for effort, expected in ((None, "medium"), ("low", "low"), ("high", "high")):
        extra = {} if effort is None else {"reasoning_effort": effort}
        response = await client.chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, max_tokens=400, **extra
        )
        assert response.choices[0].message.content == "Hello there!"
        prompt = GPT_OSS.decode(cluster.prefills[0].requests[-1].token_ids)
        assert prompt.startswith(f"<|start|>system<|message|>Reasoning: {expected}<|end|>")
    responses = cluster.openai().responses
    response = await responses.create(model=MODEL_NAME, input="Hi", reasoning={"effort": "low"})
    assert response.output_text == "Hello there!"
    assert response.reasoning is not None and response.reasoning.effort == "low"
    prompt = GPT_OSS.decode(cluster.prefills[0].requests[-1].token_ids)
    assert prompt.startswith("<|start|>system<|message|>Reasoning: low<|end|>")


async def test_an_assistant_reply_begun_for_the_model_is_continued(cluster: Cluster) -> None:
    await _start(cluster, GPT_OSS)
    GPT_OSS.script(cluster, "<|channel|>final<|message|>Paris.<|return|>")
    client = cluster.openai()
    begun = [*QUESTION, {"role": "assistant", "content": "It is sunny in"}]
    continued = {"continue_final_message": True, "add_generation_prompt": False}
    await client.chat.completions.create(
        model=MODEL_NAME, messages=begun, max_tokens=400, extra_body=continued
    )
    prompt = GPT_OSS.decode(cluster.prefills[0].requests[-1].token_ids)
    assert prompt.endswith(
        "<|start|>user<|message|>Weather in Zürich?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny in"
    )
    await client.chat.completions.create(model=MODEL_NAME, messages=begun, max_tokens=400)
    prompt = GPT_OSS.decode(cluster.prefills[0].requests[-1].token_ids)
    assert prompt.endswith("It is sunny in<|end|><|start|>assistant")  # a new turn after it
    num_sent = len(cluster.prefills[0].requests)
    for messages, extra, param in (
        (begun, {"continue_final_message": True}, "add_generation_prompt"),
        (QUESTION, continued, "continue_final_message"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=400, extra_body=extra
            )
        assert caught.value.body["param"] == param  # type: ignore[index]
    assert len(cluster.prefills[0].requests) == num_sent


async def test_grpc_chat_gives_gpt_oss_the_reasoning_effort(cluster: Cluster) -> None:
    await _start(cluster, GPT_OSS)
    GPT_OSS.script(cluster, HARMONY_ANSWER)

    def request(effort: str) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(
            model=MODEL_NAME,
            chat=generation_pb2.ChatMessages(
                messages=[generation_pb2.ChatMessage(role="user", content="Hi")],
                reasoning_effort=effort,
            ),
            sampling=common_pb2.SamplingParams(max_tokens=400),
        )

    async with insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        for effort, expected in (("", "medium"), ("high", "high")):
            responses = [r async for r in stub.Generate(request(effort))]
            assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
            prompt = GPT_OSS.decode(cluster.prefills[0].requests[-1].token_ids)
            assert prompt.startswith(f"<|start|>system<|message|>Reasoning: {expected}<|end|>")
        num_sent = len(cluster.prefills[0].requests)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [r async for r in stub.Generate(request("extreme"))]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(caught.value).metadata["param"] == "chat.reasoning_effort"
    assert len(cluster.prefills[0].requests) == num_sent


async def test_gpt_oss_plain_completions_keep_the_raw_text(cluster: Cluster) -> None:
    await _start(cluster, GPT_OSS)
    GPT_OSS.script(cluster, HARMONY_ANSWER)
    response = await cluster.openai().completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=400
    )
    assert response.choices[0].text == "analysisSimple greeting.assistantfinalHello there!"


@pytest.mark.parametrize("is_stream", [False, True])
async def test_deepseek_reasoning_and_a_call(cluster: Cluster, is_stream: bool) -> None:
    await _start(cluster, DEEPSEEK)
    DEEPSEEK.script(cluster, DEEPSEEK_CALL)
    message = await _chat(cluster, is_stream, tools=TOOLS)
    assert message == {
        "content": "Let me check.",
        "reasoning": "The user wants the weather.\n",
        "calls": [("get_weather", ARGUMENTS)],
        "finish_reason": "tool_calls",
    }
    # the template renders no tools: they reach the model in DeepSeek's own call format
    prompt = DEEPSEEK.decode(cluster.prefills[0].requests[-1].token_ids)
    assert '"name": "get_weather"' in prompt and "<｜tool▁calls▁begin｜>" in prompt
    assert prompt.endswith("<｜User｜>Weather in Zürich?<｜Assistant｜><think>\n")


async def test_deepseek_tool_choice_none_leaves_the_markup_unread(cluster: Cluster) -> None:
    await _start(cluster, DEEPSEEK)
    DEEPSEEK.script(cluster, DEEPSEEK_CALL)
    message = await _chat(cluster, False, tools=TOOLS, tool_choice="none")
    assert message["calls"] == [] and message["finish_reason"] == "stop"
    # not read for calls: the markup's tokens are special and left out of the text
    assert message["content"] == f"Let me check.functionget_weather\n```json\n{ARGUMENTS}\n```"
