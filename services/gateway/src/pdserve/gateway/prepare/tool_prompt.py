"""A conversation with tools as the chat template gets it.

What the template renders itself gets transformers' shapes (``apply_chat_template(messages,
tools=...)``): ``tools`` as OpenAI's function tools, an assistant message's ``tool_calls`` with
their arguments as a mapping, ``tool`` messages with their ``tool_call_id``. What it does not
render (`pdserve.tokenizer.ToolSupport`, probed once per template) is written into the messages
in the model's call format (`pdserve.gateway.tools.formats`), so the model still sees it:

* tools: an instruction listing them and the call format, appended to the first system message
  (or a system message of its own; or, for a template without system messages, before the
  first message's text);
* an assistant message's calls: its text followed by the calls as the model would write them;
* a tool message: a user message with the result in ``<tool_response>`` tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.gateway.prepare.params import ChatMessage
from pdserve.gateway.tools.formats import ToolCallFormat
from pdserve.gateway.tools.spec import FunctionTool
from pdserve.tokenizer import ToolSupport


def template_inputs(
    messages: Sequence[ChatMessage],
    tools: Sequence[FunctionTool],
    call_format: ToolCallFormat,
    support: ToolSupport,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` variable to render (None: the template gets none)."""
    chat = [_message(message, call_format, support) for message in messages]
    if not tools:
        return chat, None
    if support.tools:
        return chat, [tool.to_template() for tool in tools]
    return _with_instruction(chat, call_format.tools_prompt(tools), support), None


def _message(
    message: ChatMessage, call_format: ToolCallFormat, support: ToolSupport
) -> dict[str, Any]:
    if message.role == "tool" and not support.tool_responses:
        return {"role": "user", "content": call_format.result_text(message.content or "")}
    rendered: dict[str, Any] = {"role": message.role}
    if message.content is not None:
        rendered["content"] = message.content
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.reasoning is not None:
        # NOTE: Qwen3's and DeepSeek's templates read reasoning_content, gpt-oss's thinking.
        rendered["reasoning_content"] = rendered["thinking"] = message.reasoning
    if message.tool_calls:
        if support.tool_calls:
            rendered["tool_calls"] = [call.to_template() for call in message.tool_calls]
        else:
            calls = call_format.calls_text(message.tool_calls)
            rendered["content"] = f"{message.content}\n{calls}" if message.content else calls
    return rendered


def _with_instruction(
    chat: list[dict[str, Any]], instruction: str, support: ToolSupport
) -> list[dict[str, Any]]:
    first = chat[0]
    if first["role"] == "system":
        content = first.get("content")
        text = f"{content}\n\n{instruction}" if content else instruction
        return [{**first, "content": text}, *chat[1:]]
    if support.system:
        return [{"role": "system", "content": instruction}, *chat]
    content = first.get("content")
    text = f"{instruction}\n\n{content}" if content else instruction
    return [{**first, "content": text}, *chat[1:]]
