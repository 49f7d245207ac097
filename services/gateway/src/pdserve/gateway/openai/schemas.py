"""Request bodies of the OpenAI-compatible endpoints, and their translation to `GenerationParams`.

Bodies are parsed strictly: unknown fields are refused (as the OpenAI API does), and no value
is coerced to another type (``"stream": "yes"``, ``"temperature": true`` and ``"prompt":
[true]`` are 400s; an integer is accepted where a number is expected). Non-finite numbers are
refused. Every OpenAI parameter pdserve does not implement is accepted only at its neutral value
(``n: 1``, ``logprobs: false``...): any other value is a 400, never silently ignored.
Extensions (as in vLLM): ``top_k``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``.

Ranges, limits, Unicode and roles are checked after the translation, by the validator both
front ends share (`pdserve.gateway.prepare.validation`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.prepare.params import ChatMessage, GenerationParams, PromptKind

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Body(BaseModel):
    model_config = _STRICT


class StreamOptions(_Body):
    """``stream_options``: only ``include_usage`` is supported."""

    include_usage: bool = False


class _SamplingBody(_Body):
    """Parameters both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    # Accepted only at their neutral values (see `unsupported_parameter`).
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def _unsupported(self) -> tuple[str, str] | None:
        if self.n not in (None, 1):
            return "n", "only n=1 is supported"
        if self.presence_penalty not in (None, 0):
            return "presence_penalty", "presence_penalty is not supported"
        if self.frequency_penalty not in (None, 0):
            return "frequency_penalty", "frequency_penalty is not supported"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        return None

    def _stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _params(self, kind: PromptKind, **prompt: Any) -> GenerationParams:
        # NOTE: vLLM's convention -1 disables top_k; the contract uses 0.
        top_k = 0 if self.top_k == -1 else self.top_k
        return GenerationParams(
            model=self.model,
            kind=kind,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=top_k,
            seed=self.seed,
            stop=self._stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            user=self.user,
            **prompt,
        )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingBody):
    """Body of ``POST /v1/completions``."""

    # NOTE: tried in order: pydantic's default "smart" union tries every member, which makes a
    # long list of token ids about six times slower to parse.
    prompt: str | list[int] | list[str] | list[list[int]] = Field(union_mode="left_to_right")
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def to_params(self) -> GenerationParams:
        """The request as `GenerationParams`.

        Raises:
            PdserveError: INVALID_REQUEST for an unsupported parameter or prompt shape.
        """
        problem = self._unsupported()
        if problem is None:
            if self.echo:
                problem = "echo", "echo is not supported"
            elif self.best_of not in (None, 1):
                problem = "best_of", "only best_of=1 is supported"
            elif self.logprobs is not None:
                problem = "logprobs", "logprobs is not supported"
            elif self.suffix:
                problem = "suffix", "suffix is not supported"
        if problem is not None:
            raise unsupported(*problem)
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise unsupported("prompt", "only one prompt per request is supported")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._params(PromptKind.COMPLETION, text=prompt)
        return self._params(PromptKind.COMPLETION, token_ids=tuple(prompt))


# NOTE: messages and their parts are TypedDicts (plain dicts), not models: they validate about
# five times faster, which matters for a body of many thousands of messages.


class TextContentPart(TypedDict):
    """A text part of a message's content (other part types are not supported)."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    type: Literal["text"]
    text: str


class ChatMessageBody(TypedDict):
    """One message of ``messages``."""

    __pydantic_config__ = _STRICT  # type: ignore[misc]
    role: str
    content: NotRequired[str | list[TextContentPart] | None]
    name: NotRequired[str | None]


class ChatCompletionRequest(_SamplingBody):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessageBody] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    def to_params(self) -> GenerationParams:
        """The request as `GenerationParams`.

        Raises:
            PdserveError: INVALID_REQUEST for an unsupported parameter or message.
        """
        problem = self._unsupported()
        if problem is None:
            problem = self._unsupported_chat()
        if problem is not None:
            raise unsupported(*problem)
        messages = []
        for message in self.messages:
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(part["text"] for part in content)
            messages.append(ChatMessage(message["role"], content or ""))
        params = self._params(PromptKind.CHAT, messages=tuple(messages))
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise unsupported("max_tokens", "max_tokens and max_completion_tokens differ")
            return dataclasses.replace(
                params,
                max_tokens=self.max_completion_tokens,
                max_tokens_name="max_completion_tokens",
            )
        return params

    def _unsupported_chat(self) -> tuple[str, str] | None:
        if self.logprobs:
            return "logprobs", "logprobs is not supported"
        if self.top_logprobs:
            return "top_logprobs", "top_logprobs is not supported"
        if self.tools:
            return "tools", "tools are not supported"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool_choice is not supported"
        if self.functions:
            return "functions", "functions are not supported"
        if self.function_call not in (None, "none"):
            return "function_call", "function_call is not supported"
        if self.response_format not in (None, {"type": "text"}):
            return "response_format", "only response_format {'type': 'text'} is supported"
        if self.store:
            return "store", "store is not supported"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", "service_tier is not supported"
        return None


def unsupported(param: str, message: str) -> PdserveError:
    """An INVALID_REQUEST error naming the offending parameter."""
    return PdserveError(ErrorReason.INVALID_REQUEST, message, {"param": param})
