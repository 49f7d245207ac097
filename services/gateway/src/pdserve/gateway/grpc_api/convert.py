"""The public GenerationService's messages to and from the gateway's plain dataclasses.

The servicer (`pdserve.gateway.grpc_api.servicer`) and the parser of its requests call these
at the edge; nothing behind them sees a protobuf message.
"""

from __future__ import annotations

from typing import get_args

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import Constraint
from pdserve.gateway.prepare.params import (
    ChatMessage,
    GenerationParams,
    PromptKind,
    ReasoningEffort,
    effort_variables,
)
from pdserve.gateway.request import OutputDelta, Usage
from pdserve.gateway.tools.spec import FunctionTool, ToolCall, ToolChoice, ToolChoiceMode
from pdserve.serving.convert import (
    constraint_from_proto,
    finish_reason_to_proto,
    logprobs_to_proto,
)
from pdserve.v1 import common_pb2, generation_pb2


def generation_params_from_pb(message: generation_pb2.GenerateRequest) -> GenerationParams:
    """GenerateRequest -> `GenerationParams` (validated later, like a REST request).

    Raises:
        PdserveError: INVALID_REQUEST when no input or no sampling is given.
    """
    kind = message.WhichOneof("input")
    if kind is None:
        raise PdserveError(
            ErrorReason.INVALID_REQUEST,
            "one of text, token_ids or chat is required",
            {"param": "input"},
        )
    if not message.HasField("sampling"):
        raise PdserveError(
            ErrorReason.INVALID_REQUEST, "sampling.max_tokens is required", {"param": "sampling"}
        )
    sampling = message.sampling
    params = GenerationParams(
        model=message.model,
        kind=PromptKind.CHAT if kind == "chat" else PromptKind.COMPLETION,
        text=message.text if kind == "text" else None,
        token_ids=tuple(message.token_ids.token_ids) if kind == "token_ids" else None,
        messages=tuple(_message_from_pb(m) for m in message.chat.messages)
        if kind == "chat"
        else None,
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature if sampling.HasField("temperature") else None,
        top_p=sampling.top_p if sampling.HasField("top_p") else None,
        top_k=sampling.top_k if sampling.HasField("top_k") else None,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(message.stop),
        stop_token_ids=tuple(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        client_request_id=message.request_id or None,
        user=message.user or None,
        presence_penalty=_optional(sampling, "presence_penalty"),
        frequency_penalty=_optional(sampling, "frequency_penalty"),
        repetition_penalty=_optional(sampling, "repetition_penalty"),
        logit_bias=tuple(sampling.logit_bias.items()),
        min_tokens=sampling.min_tokens,
        min_p=_optional(sampling, "min_p"),
        logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
        prompt_logprobs=sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None,
        n=message.n or 1,
        tools=tuple(_tool_from_pb(tool) for tool in message.tools),
        tool_choice=_tool_choice_from_pb(message),
        parallel_tool_calls=(
            message.parallel_tool_calls if message.HasField("parallel_tool_calls") else True
        ),
        constraint=_constraint(sampling),
        constraint_name="sampling.constraint",
        template_variables=_template_variables(message.chat) if kind == "chat" else (),
        include_stop_str_in_output=message.include_stop_str_in_output,
        skip_special_tokens=(
            message.skip_special_tokens if message.HasField("skip_special_tokens") else True
        ),
        truncate_prompt_tokens=message.truncate_prompt_tokens or None,
        allowed_token_ids=tuple(sampling.allowed_token_ids),
        bad_words=tuple(message.bad_words),
        bad_word_ids=tuple(tuple(word.token_ids) for word in sampling.bad_words),
    )
    return params


EFFORTS = get_args(ReasoningEffort)


def _template_variables(chat: generation_pb2.ChatMessages) -> tuple[tuple[str, str], ...]:
    """What the chat template gets besides the messages and tools (contract 1.17)."""
    effort = chat.reasoning_effort
    if not effort:
        return ()
    if effort not in EFFORTS:
        raise PdserveError(
            ErrorReason.INVALID_REQUEST,
            f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {effort[:32]!r}",
            {"param": "chat.reasoning_effort"},
        )
    return effort_variables(effort)


def _message_from_pb(message: generation_pb2.ChatMessage) -> ChatMessage:
    """A chat message (proto3 has no absent text: an assistant message with calls and empty
    text has none)."""
    calls = tuple(
        ToolCall(call.id, call.function.name, call.function.arguments)
        for call in message.tool_calls
    )
    content = None if calls and not message.content else message.content
    return ChatMessage(
        message.role,
        content,
        message.name or None,
        calls,
        message.tool_call_id or None,
        message.reasoning_content or None,
    )


def _tool_from_pb(tool: generation_pb2.Tool) -> FunctionTool:
    function = tool.function
    return FunctionTool(
        function.name,
        function.description or None,
        function.parameters or None,
        function.strict if function.HasField("strict") else None,
    )


_TOOL_CHOICE_MODES = {
    generation_pb2.TOOL_CHOICE_MODE_NONE: ToolChoiceMode.NONE,
    generation_pb2.TOOL_CHOICE_MODE_AUTO: ToolChoiceMode.AUTO,
    generation_pb2.TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode.REQUIRED,
}


def _tool_choice_from_pb(message: generation_pb2.GenerateRequest) -> ToolChoice | None:
    """The request's tool_choice (None: unset, the default)."""
    if not message.HasField("tool_choice"):
        return None
    choice = message.tool_choice
    which = choice.WhichOneof("choice")
    if which == "function_name":
        return ToolChoice(ToolChoiceMode.FUNCTION, choice.function_name)
    mode = _TOOL_CHOICE_MODES.get(choice.mode) if which == "mode" else None
    return None if mode is None else ToolChoice(mode)


def _constraint(sampling: common_pb2.SamplingParams) -> Constraint | None:
    """The sampling's constraint, if set.

    Raises:
        PdserveError: INVALID_REQUEST for a constraint with no kind or an empty value.
    """
    if not sampling.HasField("constraint"):
        return None
    try:
        return constraint_from_proto(sampling.constraint)
    except ValueError as error:
        raise PdserveError(
            ErrorReason.INVALID_REQUEST, str(error), {"param": "sampling.constraint"}
        ) from None


def _optional(sampling: common_pb2.SamplingParams, name: str) -> float | None:
    """An optional float field's value, or None when unset."""
    return float(getattr(sampling, name)) if sampling.HasField(name) else None


def usage_to_pb(usage: Usage) -> common_pb2.Usage:
    """`Usage` -> Usage message."""
    return common_pb2.Usage(
        num_prompt_tokens=usage.num_prompt_tokens,
        num_completion_tokens=usage.num_completion_tokens,
        num_cached_prompt_tokens=usage.num_cached_prompt_tokens,
    )


def generate_response_to_pb(
    request_id: str, delta: OutputDelta, prompt_token_ids: tuple[int, ...] = (), index: int = 0
) -> generation_pb2.GenerateResponse:
    """`OutputDelta` of choice `index` -> GenerateResponse (finish reason and usage only on
    the choice's last one)."""
    message = generation_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=list(delta.token_ids),
        first_index=delta.first_index,
        text=delta.text,
        prompt_token_ids=list(prompt_token_ids),
        logprobs=[logprobs_to_proto(lp) for lp in delta.logprobs],
        prompt_logprobs=[logprobs_to_proto(lp) for lp in delta.prompt_logprobs],
        index=index,
    )
    for call in delta.tool_calls:
        message.tool_calls.add(
            index=call.index, id=call.id or "", name=call.name or "", arguments=call.arguments
        )
    if delta.finish_reason is not None:
        message.finish_reason = finish_reason_to_proto(delta.finish_reason)
    if delta.usage is not None:
        message.usage.CopyFrom(usage_to_pb(delta.usage))
    return message
