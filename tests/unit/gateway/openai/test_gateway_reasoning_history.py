"""Reasoning sent back with a conversation: a chat assistant message's ``reasoning_content``
(REST or gRPC) and a Responses ``reasoning`` item become the assistant turn's reasoning, which the
chat template reads where the families' templates look for it (Qwen3's and DeepSeek's
``reasoning_content``, gpt-oss's ``thinking``)."""

from __future__ import annotations

from typing import Any

import pytest
import tokenizers
from support.gateway_fakes import tokenizer_json
from transformers import PreTrainedTokenizerFast

from pdserve.common.errors import PdserveError
from pdserve.gateway.grpc_api.convert import generation_params_from_pb
from pdserve.gateway.openai.chat_bodies import message_from_body
from pdserve.gateway.openai.responses_api.convert import to_params
from pdserve.gateway.openai.responses_api.schemas import ResponsesRequest
from pdserve.gateway.prepare.messages import checked_messages
from pdserve.gateway.prepare.params import ChatMessage
from pdserve.gateway.prepare.tool_prompt import template_inputs
from pdserve.gateway.prepare.validation import RequestLimits
from pdserve.gateway.tools.formats import FORMATS, HERMES
from pdserve.gateway.tools.spec import ToolCall
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, generation_pb2

# NOTE: the assistant-turn part of Qwen3's published template: reasoning after the last user
# query is rendered in a think block, earlier reasoning is left out.
QWEN3_TEMPLATE = """{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" and ns.last_query_index == messages|length - 1 %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {%- set content = message.content or '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- set reasoning_content = '' %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n' + tool_call.function.name + '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""  # noqa: E501


def _responses_messages(items: list[dict[str, Any]]) -> tuple[ChatMessage, ...]:
    request = ResponsesRequest.model_validate({"model": "m", "input": items})
    messages = to_params(request, RequestLimits()).messages
    assert messages is not None
    return checked_messages(messages)


USER = {"role": "user", "content": "What is 6 x 7?"}
REASONING = {
    "type": "reasoning",
    "id": "rs_1",
    "summary": [],
    "content": [{"type": "reasoning_text", "text": "Six sevens "}, {"type": "reasoning_text",
                                                                     "text": "are 42."}],
}  # fmt: skip
ANSWER = {
    "type": "message",
    "id": "msg_1",
    "role": "assistant",
    "status": "completed",
    "content": [{"type": "output_text", "text": "42", "annotations": []}],
}
CALL = {"type": "function_call", "call_id": "c1", "name": "multiply", "arguments": "{}"}


def test_a_reasoning_item_is_the_reasoning_of_the_answer_after_it() -> None:
    messages = _responses_messages([USER, REASONING, ANSWER, {"role": "user", "content": "x"}])
    assert [m.role for m in messages] == ["user", "assistant", "user"]
    assert (messages[1].content, messages[1].reasoning) == ("42", "Six sevens are 42.")


def test_a_reasoning_item_before_calls_is_their_assistant_turns_reasoning() -> None:
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    messages = _responses_messages([USER, REASONING, CALL, output])
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].reasoning == "Six sevens are 42."
    assert messages[1].content is None
    assert [call.id for call in messages[1].tool_calls] == ["c1"]


def test_reasoning_with_nothing_after_it_is_an_assistant_turn_without_text() -> None:
    summary_only = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Sums."}]}
    messages = _responses_messages([USER, summary_only])
    assert (messages[1].role, messages[1].content, messages[1].reasoning) == (
        "assistant",
        "",
        "Sums.",
    )


def test_encrypted_reasoning_is_refused_by_name() -> None:
    encrypted = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}
    with pytest.raises(PdserveError) as refused:
        _responses_messages([USER, encrypted, ANSWER])
    assert refused.value.metadata["param"] == "input[1].encrypted_content"
    assert "encrypted reasoning" in refused.value.message


def test_a_chat_assistant_messages_reasoning_content_is_kept_and_only_there() -> None:
    body = {"role": "assistant", "content": "42", "reasoning_content": "Six sevens are 42."}
    assert message_from_body(body).reasoning == "Six sevens are 42."  # type: ignore[arg-type]
    user = message_from_body({"role": "user", "content": "hi", "reasoning_content": "no"})  # type: ignore[typeddict-unknown-key]
    with pytest.raises(PdserveError) as refused:
        checked_messages((user,))
    assert refused.value.metadata["param"] == "messages[0].reasoning_content"


def test_the_template_reads_the_reasoning_where_qwen3s_does_as_transformers() -> None:
    tokenizer = Tokenizer(tokenizer_json(), chat_template=QWEN3_TEMPLATE)
    call = ToolCall("c1", "multiply", "{}")
    conversation = (
        ChatMessage("user", "What is 6 x 7?"),
        ChatMessage("assistant", None, tool_calls=(call,), reasoning="I should multiply."),
        ChatMessage("tool", "42", tool_call_id="c1"),
        ChatMessage("assistant", "42", reasoning="The tool says 42."),
    )
    messages, _ = template_inputs(conversation, (), FORMATS[HERMES], tokenizer.tool_support)
    assert messages[1]["reasoning_content"] == messages[1]["thinking"] == "I should multiply."
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    backend = tokenizers.Tokenizer.from_str(tokenizer_json())
    reference = PreTrainedTokenizerFast(tokenizer_object=backend)
    hf_messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is 6 x 7?"},
        {
            "role": "assistant",
            "reasoning_content": "I should multiply.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": {}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "42", "reasoning_content": "The tool says 42."},
    ]
    expected = reference.apply_chat_template(
        hf_messages, chat_template=QWEN3_TEMPLATE, tokenize=False
    )
    assert ours == expected
    assert "<think>\nI should multiply.\n</think>" in ours
    assert "<think>\nThe tool says 42.\n</think>\n\n42" in ours


def test_a_grpc_assistant_messages_reasoning_content_is_kept() -> None:
    request = generation_pb2.GenerateRequest(
        model="m",
        sampling=common_pb2.SamplingParams(max_tokens=4),
        chat=generation_pb2.ChatMessages(
            messages=[
                generation_pb2.ChatMessage(role="user", content="What is 6 x 7?"),
                generation_pb2.ChatMessage(
                    role="assistant", content="42", reasoning_content="Six sevens are 42."
                ),
                generation_pb2.ChatMessage(role="user", content="And 6 x 8?"),
            ]
        ),
    )
    messages = generation_params_from_pb(request).messages
    assert messages is not None
    assert [m.reasoning for m in checked_messages(messages)] == [None, "Six sevens are 42.", None]
