"""What the completions and chat bodies share: the strict body, the sampling parameters, the
stream options and the constraints (``response_format``, ``structured_outputs``, ``guided_*``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import Constraint, ConstraintKind
from pdserve.gateway.openai.strict import STRICT
from pdserve.gateway.prepare.params import GenerationParams, PromptKind

SafetyIdentifier = Annotated[str, Field(max_length=64)]  # OpenAI's bound
"""``safety_identifier`` (chat, completions, responses): the request's user in logs and spans
when ``user`` is unset (`user_of`)."""
PromptCacheKey = Annotated[str, Field(max_length=256)]
"""``prompt_cache_key``: accepted; the prefix cache is keyed by the prompt's tokens."""
PromptCacheRetention = Literal["in-memory", "24h"]


def user_of(user: str | None, safety_identifier: str | None) -> str | None:
    """Who a request is for, in logs and spans: ``user``, else ``safety_identifier``."""
    return user if user is not None else safety_identifier


MAX_COMPLETION_LOGPROBS = 5  # the completions API's bound on logprobs (chat: 20)


class StrictBody(BaseModel):
    """A body parsed strictly: unknown fields refused, no value coerced to another type."""

    model_config = STRICT


class StreamOptions(StrictBody):
    """``stream_options``: a last usage chunk, or usage so far on every chunk; ``resumable``
    (pdserve's extension): the stream can be resumed, on any gateway, from a completion index
    (`pdserve.gateway.openai.resumable`)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False
    resumable: bool = False


class StructuredOutputs(StrictBody):
    """``structured_outputs`` (vLLM's extension): exactly one constraint."""

    # NOTE: "json" would shadow BaseModel.json.
    json_value: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def schema_text(schema: str | dict[str, Any], param: str) -> str:
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


def response_format_constraint(value: dict[str, Any]) -> Constraint | None:
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


class SharedSampling(StrictBody):
    """What the completions, chat and Responses bodies share: the model, the stream switch,
    the sampling parameters (with vLLM's extensions) and who the request is for."""

    model: str
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    user: str | None = None
    safety_identifier: SafetyIdentifier | None = None
    prompt_cache_key: PromptCacheKey | None = None
    prompt_cache_retention: PromptCacheRetention | None = None

    def shared_params(self) -> dict[str, Any]:
        """The `GenerationParams` fields these set."""
        # NOTE: vLLM's convention -1 disables top_k; the contract uses 0.
        stop = self.stop
        return {
            "model": self.model,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": 0 if self.top_k == -1 else self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": (stop,) if isinstance(stop, str) else tuple(stop or ()),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens or 0,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "user": user_of(self.user, self.safety_identifier),
        }


class SamplingBody(SharedSampling):
    """Parameters the completions and chat endpoints share."""

    max_tokens: int | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def _unsupported(self) -> tuple[str, str] | None:
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        return None

    def _constraint(self) -> tuple[Constraint | None, str]:
        """The request's constraint and the parameter that set it; at most one may be set."""
        found: list[tuple[Constraint | None, str]] = []
        if self.response_format is not None:
            found.append((response_format_constraint(self.response_format), "response_format"))
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
                return Constraint(ConstraintKind.JSON_SCHEMA, schema_text(value, name))
            if kind == "json_object":
                return Constraint(ConstraintKind.JSON_OBJECT)
            if kind == "choice":
                return Constraint(ConstraintKind.CHOICE, choices=tuple(value))
            return Constraint(ConstraintKind(kind), value)
        except ValueError as error:
            raise unsupported(name, str(error)) from None

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` with its keys (token ids as JSON strings) as integers."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 10:
                raise unsupported("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            pairs.append((int(key), value))
        return tuple(pairs)

    def _params(self, kind: PromptKind, **prompt: Any) -> GenerationParams:
        constraint, constraint_name = self._constraint()
        return GenerationParams(
            **self.shared_params(),
            constraint=constraint,
            constraint_name=constraint_name,
            n=1 if self.n is None else self.n,
            logit_bias=self._logit_bias(),
            prompt_logprobs=self.prompt_logprobs,
            kind=kind,
            max_tokens=self.max_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            allowed_token_ids=tuple(self.allowed_token_ids or ()),
            bad_words=tuple(self.bad_words or ()),
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


def unsupported(param: str, message: str) -> PdserveError:
    """An INVALID_REQUEST error naming the offending parameter."""
    return PdserveError(ErrorReason.INVALID_REQUEST, message, {"param": param})
