"""Request bodies of the OpenAI-compatible endpoints, and their translation to `GenerationParams`.

Bodies are parsed strictly: unknown fields are refused (as the OpenAI API does), and no value
is coerced to another type (``"stream": "yes"``, ``"temperature": true`` and ``"prompt":
[true]`` are 400s; an integer is accepted where a number is expected). Non-finite numbers are
refused. Every OpenAI parameter pdserve does not implement is accepted only at its neutral value
(``best_of: 1``, ``store: false``...): any other value is a 400, never
silently ignored. Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant
``tool_calls`` and ``tool`` messages) are OpenAI's; the deprecated ``functions`` and
``function_call`` are refused.
Extensions (as in vLLM): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``stop_token_ids``, ``ignore_eos``, ``return_token_ids``, ``prompt_logprobs``,
``stream_options.continuous_usage_stats``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``truncate_prompt_tokens``, ``add_generation_prompt`` and
``continue_final_message`` (chat), and the constraints ``structured_outputs`` (one of
``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``; ``response_format`` is accepted on
completions too.

Ranges, limits, Unicode and roles are checked after the translation, by the validator both
front ends share (`pdserve.gateway.prepare.validation`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import Field

from pdserve.gateway.openai.chat_bodies import (
    ChatMessageBody,
    NamedToolChoiceBody,
    ToolBody,
    message_from_body,
    tool_choice_from_body,
    tool_from_body,
)
from pdserve.gateway.openai.sampling_body import (
    MAX_COMPLETION_LOGPROBS,
    SamplingBody,
    StrictBody,
    unsupported,
)
from pdserve.gateway.prepare.params import (
    REASONING_EFFORT,
    GenerationParams,
    PromptKind,
    ReasoningEffort,
    effort_variables,
)


class CompletionRequest(SamplingBody):
    """Body of ``POST /v1/completions``."""

    # NOTE: tried in order: pydantic's default "smart" union tries every member, which makes a
    # long list of token ids about six times slower to parse.
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def to_params(self) -> list[GenerationParams]:
        """The request as `GenerationParams`, one per prompt of a prompt list.

        ``logprobs`` (0 to 5) asks for each token's logprob and that many alternatives;
        ``echo`` with it asks for the prompt's too (``max_tokens`` 0 then scores the prompt
        alone).

        Raises:
            PdserveError: INVALID_REQUEST for an unsupported parameter or prompt shape.
        """
        problem = self._unsupported()
        if problem is None:
            if self.best_of not in (None, 1):
                problem = "best_of", "only best_of=1 is supported (use n)"
            elif self.suffix:
                problem = "suffix", "suffix is not supported"
        if problem is not None:
            raise unsupported(*problem)
        prompt = self.prompt
        prompts: list[str | list[int]]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompts = list(prompt)
        else:
            prompts = [prompt]  # type: ignore[list-item]
        echo = bool(self.echo)
        prompt_logprobs = self.prompt_logprobs
        if echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs
        params = []
        for one in prompts:
            prompt_input: dict[str, Any] = (
                {"text": one} if isinstance(one, str) else {"token_ids": tuple(one)}
            )
            params.append(
                dataclasses.replace(
                    self._params(PromptKind.COMPLETION, **prompt_input),
                    logprobs=self.logprobs,
                    prompt_logprobs=prompt_logprobs,
                    echo=echo,
                    max_logprobs=MAX_COMPLETION_LOGPROBS,
                )
            )
        return params


# NOTE: what the template gets from the request itself; chat_template_kwargs adds to it only.
TEMPLATE_INPUTS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatCompletionRequest(SamplingBody):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessageBody] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolBody] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoiceBody | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    def to_params(self) -> list[GenerationParams]:
        """The request as `GenerationParams` (a list of one, as for completions).

        ``logprobs: true`` asks for each token's logprob, ``top_logprobs`` (0 to 20) for that
        many alternatives. ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are
        OpenAI's (`pdserve.gateway.tools`). ``reasoning_effort`` goes to the chat template
        with ``chat_template_kwargs``.

        Raises:
            PdserveError: INVALID_REQUEST for an unsupported parameter or message.
        """
        problem = self._unsupported()
        if problem is None:
            problem = self._unsupported_chat()
        if problem is not None:
            raise unsupported(*problem)
        params = dataclasses.replace(
            self._params(
                PromptKind.CHAT,
                messages=tuple(
                    message_from_body(m, f"messages[{i}]") for i, m in enumerate(self.messages)
                ),
            ),
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            logprobs_name="top_logprobs",
            tools=tuple(tool_from_body(tool) for tool in self.tools or ()),
            tool_choice=tool_choice_from_body(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls is not False,
            shows_reasoning=True,
            template_variables=tuple(self._template_variables().items()),
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
        )
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise unsupported("max_tokens", "max_tokens and max_completion_tokens differ")
            params = dataclasses.replace(
                params,
                max_tokens=self.max_completion_tokens,
                max_tokens_name="max_completion_tokens",
            )
        return [params]

    def _template_variables(self) -> dict[str, Any]:
        return {
            **(self.chat_template_kwargs or {}),
            **dict(effort_variables(self.reasoning_effort)),
        }

    def _unsupported_chat(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.functions:
            return "functions", "functions are not supported (use tools)"
        if self.function_call not in (None, "none"):
            return "function_call", "function_call is not supported (use tool_choice)"
        if self.store:
            return "store", "store is not supported"
        kwargs = self.chat_template_kwargs or {}
        taken = set(kwargs) & TEMPLATE_INPUTS
        if taken:
            return "chat_template_kwargs", f"{sorted(taken)[0]} is set by the request itself"
        asked = kwargs.get(REASONING_EFFORT, self.reasoning_effort)
        if self.reasoning_effort is not None and asked != self.reasoning_effort:
            return "reasoning_effort", (
                "reasoning_effort and chat_template_kwargs.reasoning_effort differ"
            )
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", "service_tier is not supported"
        return self._unsupported_continuation()

    def _unsupported_continuation(self) -> tuple[str, str] | None:
        if self.continue_final_message:
            if self.add_generation_prompt:
                return "add_generation_prompt", (
                    "continue_final_message needs add_generation_prompt: false"
                )
            if self.messages[-1].get("role") != "assistant":
                return "continue_final_message", (
                    "continue_final_message continues an assistant message: the last message "
                    "must be one"
                )
        return None


class TokenizeRequest(StrictBody):
    """Body of ``POST /tokenize`` (as vLLM's): a text prompt, or chat messages rendered with
    the model's template as a chat request would be."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    tools: list[ToolBody] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def to_params(self) -> GenerationParams:
        """The prompt as `GenerationParams` (validated like a generation request's)."""
        if (self.prompt is None) == (self.messages is None):
            raise unsupported("prompt", "exactly one of prompt and messages is required")
        if self.messages is not None:
            chat = ChatCompletionRequest(
                model=self.model,
                messages=self.messages,
                tools=self.tools,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
            )
            return chat.to_params()[0]
        if self.tools:
            raise unsupported("tools", "tools need messages")
        if self.continue_final_message or not self.add_generation_prompt:
            raise unsupported(
                "add_generation_prompt",
                "add_generation_prompt and continue_final_message need messages",
            )
        return GenerationParams(model=self.model, kind=PromptKind.COMPLETION, text=self.prompt)


class DetokenizeRequest(StrictBody):
    """Body of ``POST /detokenize`` (as vLLM's)."""

    model: str
    tokens: list[int]
