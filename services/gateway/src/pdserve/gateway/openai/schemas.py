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
``stream_options.continuous_usage_stats``, and the constraints ``structured_outputs`` (one of
``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``; ``response_format`` is accepted on
completions too.

Ranges, limits, Unicode and roles are checked after the translation, by the validator both
front ends share (`pdserve.gateway.prepare.validation`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import Constraint, ConstraintKind
from pdserve.gateway.openai.chat_bodies import (
    ChatMessageBody,
    NamedToolChoiceBody,
    ToolBody,
    message_from_body,
    tool_choice_from_body,
    tool_from_body,
)
from pdserve.gateway.prepare.params import GenerationParams, PromptKind

MAX_COMPLETION_LOGPROBS = 5  # the completions API's bound on logprobs (chat: 20)
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _Body(BaseModel):
    model_config = _STRICT


class StreamOptions(_Body):
    """``stream_options``: a last usage chunk, or usage so far on every chunk; ``resumable``
    (pdserve's extension): the stream can be resumed, on any gateway, from a completion index
    (`pdserve.gateway.openai.resumable`)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    resumable: bool = False


class StructuredOutputs(_Body):
    """``structured_outputs`` (vLLM's extension): exactly one constraint."""

    # NOTE: "json" would shadow BaseModel.json.
    json_value: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _schema_text(schema: str | dict[str, Any], param: str) -> str:
    """A JSON Schema given as an object or as its JSON text, as JSON text."""
    if isinstance(schema, dict):
        return json.dumps(schema)
    try:
        parsed = json.loads(schema)
    except ValueError:
        raise unsupported(param, f"{param} is not valid JSON") from None
    if not isinstance(parsed, dict | bool):
        raise unsupported(param, f"{param} must be a JSON Schema (an object)")
    return schema


def _response_format(value: dict[str, Any]) -> Constraint | None:
    """The constraint of an OpenAI ``response_format`` (None for ``text``)."""
    kind = value.get("type")
    if kind == "text" and len(value) == 1:
        return None
    if kind == "json_object" and len(value) == 1:
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if set(value) != {"type", "json_schema"} or not isinstance(spec, dict):
            raise unsupported("response_format", "json_schema needs a json_schema object")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise unsupported(
                "response_format", f"unknown json_schema fields: {', '.join(sorted(unknown))}"
            )
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise unsupported("response_format", "json_schema.schema must be a JSON Schema object")
        return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    raise unsupported(
        "response_format",
        "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
        "{'type': 'json_schema', 'json_schema': {...}}",
    )


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
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    min_p: float | None = None
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _unsupported(self) -> tuple[str, str] | None:
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        return None

    def _constraint(self) -> tuple[Constraint | None, str]:
        """The request's constraint and the parameter that set it; at most one may be set."""
        found: list[tuple[Constraint | None, str]] = []
        if self.response_format is not None:
            found.append((_response_format(self.response_format), "response_format"))
        outputs = self.structured_outputs
        if outputs is not None:
            name = "structured_outputs"
            kinds = [
                k for k, v in outputs.model_dump(by_alias=True).items() if v not in (None, False)
            ]
            if len(kinds) != 1:
                raise unsupported(name, "structured_outputs needs exactly one of json, regex, "
                                        "choice, grammar, json_object")  # fmt: skip
            value = outputs.model_dump(by_alias=True)[kinds[0]]
            found.append((self._constraint_of(kinds[0], value, name), name))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                name = f"guided_{kind}"
                found.append((self._constraint_of(kind, value, name), name))
        found = [(constraint, name) for constraint, name in found if constraint is not None]
        if len(found) > 1:
            names = " and ".join(name for _, name in found)
            raise unsupported(found[1][1], f"only one constraint may be set, got {names}")
        return found[0] if found else (None, "response_format")

    @staticmethod
    def _constraint_of(kind: str, value: Any, name: str) -> Constraint:
        try:
            if kind == "json":
                return Constraint(ConstraintKind.JSON_SCHEMA, _schema_text(value, name))
            if kind == "json_object":
                return Constraint(ConstraintKind.JSON_OBJECT)
            if kind == "choice":
                return Constraint(ConstraintKind.CHOICE, choices=tuple(value))
            return Constraint(ConstraintKind(kind), value)
        except ValueError as error:
            raise unsupported(name, str(error)) from None

    def _stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` with its keys (token ids as JSON strings) as integers."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise unsupported("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            pairs.append((int(key), value))
        return tuple(pairs)

    def _params(self, kind: PromptKind, **prompt: Any) -> GenerationParams:
        # NOTE: vLLM's convention -1 disables top_k; the contract uses 0.
        top_k = 0 if self.top_k == -1 else self.top_k
        constraint, constraint_name = self._constraint()
        return GenerationParams(
            constraint=constraint,
            constraint_name=constraint_name,
            n=1 if self.n is None else self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self._logit_bias(),
            min_tokens=self.min_tokens or 0,
            min_p=self.min_p,
            prompt_logprobs=self.prompt_logprobs,
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

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def resumable(self) -> bool:
        """Whether the stream can be resumed (``stream_options.resumable``)."""
        return bool(self.stream_options and self.stream_options.resumable)


class CompletionRequest(_SamplingBody):
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


class ChatCompletionRequest(_SamplingBody):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessageBody] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolBody] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoiceBody | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    def to_params(self) -> list[GenerationParams]:
        """The request as `GenerationParams` (a list of one, as for completions).

        ``logprobs: true`` asks for each token's logprob, ``top_logprobs`` (0 to 20) for that
        many alternatives. ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are
        OpenAI's (`pdserve.gateway.tools`).

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
                PromptKind.CHAT, messages=tuple(message_from_body(m) for m in self.messages)
            ),
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            logprobs_name="top_logprobs",
            tools=tuple(tool_from_body(tool) for tool in self.tools or ()),
            tool_choice=tool_choice_from_body(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls is not False,
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

    def _unsupported_chat(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.functions:
            return "functions", "functions are not supported (use tools)"
        if self.function_call not in (None, "none"):
            return "function_call", "function_call is not supported (use tool_choice)"
        if self.store:
            return "store", "store is not supported"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", "service_tier is not supported"
        return None


class TokenizeRequest(_Body):
    """Body of ``POST /tokenize`` (as vLLM's): a text prompt, or chat messages rendered with
    the model's template as a chat request would be."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    tools: list[ToolBody] | None = None

    def to_params(self) -> GenerationParams:
        """The prompt as `GenerationParams` (validated like a generation request's)."""
        if (self.prompt is None) == (self.messages is None):
            raise unsupported("prompt", "exactly one of prompt and messages is required")
        if self.messages is not None:
            chat = ChatCompletionRequest(model=self.model, messages=self.messages, tools=self.tools)
            return chat.to_params()[0]
        if self.tools:
            raise unsupported("tools", "tools need messages")
        return GenerationParams(model=self.model, kind=PromptKind.COMPLETION, text=self.prompt)


class DetokenizeRequest(_Body):
    """Body of ``POST /detokenize`` (as vLLM's)."""

    model: str
    tokens: list[int]


def unsupported(param: str, message: str) -> PdserveError:
    """An INVALID_REQUEST error naming the offending parameter."""
    return PdserveError(ErrorReason.INVALID_REQUEST, message, {"param": param})
