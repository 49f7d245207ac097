"""Tools and tool conversations as the chat template gets them: what a template renders itself
equals transformers' ``apply_chat_template(tools=...)``; what it does not is written in the
model's call format."""

from __future__ import annotations

import json
from typing import Any

import pytest
import tokenizers
from support.gateway_fakes import tokenizer_json
from transformers import PreTrainedTokenizerFast

from pdserve.gateway.prepare.params import ChatMessage
from pdserve.gateway.prepare.tool_prompt import template_inputs
from pdserve.gateway.tools.formats import FORMATS, HERMES, LLAMA3_JSON
from pdserve.gateway.tools.spec import FunctionTool, ToolCall
from pdserve.tokenizer import Tokenizer, ToolSupport

# NOTE: the tool parts of Qwen 2.5's published chat template.
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('only user and assistant') }}{% endif %}"
    "[{{ m.role }}] {{ m.content }}\n{% endfor %}"
)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = FunctionTool("get_weather", "Weather in a city.", json.dumps(WEATHER_SCHEMA), strict=True)
CALL = ToolCall("call_1", "get_weather", '{"city": "Zürich"}')
CONVERSATION = (
    ChatMessage("system", "Be brief."),
    ChatMessage("user", "Weather in Zürich?"),
    ChatMessage("assistant", None, tool_calls=(CALL,)),
    ChatMessage("tool", "sunny", tool_call_id="call_1"),
)


def _ours(
    template: str, call_format: str = HERMES, conversation: tuple[ChatMessage, ...] = CONVERSATION
) -> tuple[Tokenizer, str]:
    tokenizer = Tokenizer(tokenizer_json(), chat_template=template)
    messages, tools = template_inputs(
        conversation, (TOOL,), FORMATS[call_format], tokenizer.tool_support
    )
    return tokenizer, tokenizer.apply_chat_template(messages, tools=tools)


def test_a_template_with_tools_renders_as_transformers() -> None:
    tokenizer, text = _ours(QWEN25_TEMPLATE)
    assert tokenizer.tool_support == ToolSupport(True, True, True, True)
    backend = tokenizers.Tokenizer.from_str(tokenizer_json())
    reference = PreTrainedTokenizerFast(tokenizer_object=backend)
    hf_messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    hf_tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city.",
                "parameters": WEATHER_SCHEMA,
                "strict": True,
            },
        }
    ]
    expected = reference.apply_chat_template(
        hf_messages,
        tools=hf_tools,
        chat_template=QWEN25_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    tokenizer, text = _ours(SMOLLM2_TEMPLATE)
    assert tokenizer.tool_support == ToolSupport(True, False, False, True)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '"name": "get_weather", "description": "Weather in a city."' in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Zürich"}}\n</tool_call><|im_end|>'
    ) in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text


def test_a_template_without_system_or_tool_messages_gets_them_in_user_messages() -> None:
    tokenizer, text = _ours(NO_SYSTEM_TEMPLATE, LLAMA3_JSON, CONVERSATION[1:])
    assert tokenizer.tool_support == ToolSupport(False, False, False, False)
    assert text.startswith("[user] Given the following functions, please respond with a JSON")
    assert "\n\nWeather in Zürich?\n" in text
    assert '[assistant] {"name": "get_weather", "parameters": {"city": "Zürich"}}\n' in text
    assert text.endswith("[user] <tool_response>\nsunny\n</tool_response>\n")


@pytest.mark.parametrize("call_format", [HERMES, LLAMA3_JSON])
def test_fallback_writes_calls_in_the_parsers_format(call_format: str) -> None:
    support = ToolSupport(system=True, tools=False, tool_calls=False, tool_responses=False)
    messages, tools = template_inputs(CONVERSATION[1:], (TOOL,), FORMATS[call_format], support)
    assert tools is None
    assert messages[0]["role"] == "system"
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        "</tool_call>"
        if call_format == HERMES
        else '{"name": "get_weather", "parameters": {"city": "Zürich"}}',
    }
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
