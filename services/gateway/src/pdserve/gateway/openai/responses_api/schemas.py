"""The request body of ``POST /v1/responses``, parsed strictly as the other endpoints' bodies are.

Unknown fields are refused, no value is coerced, and every OpenAI parameter pdserve does not
implement is accepted only at its neutral value (``service_tier: "auto"``...): any
other value is a 400 naming it (`ResponsesRequest.refusal`). Input items and content parts are
told apart by their ``type``; an item or part of a type pdserve does not read parses as
`UnsupportedItem` / `UnsupportedPart`, so the refusal can name it (``input[2]``) instead of
listing why it matched none of the known shapes. Extensions (as on the other endpoints):
``seed``, ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``, ``stop``, ``stop_token_ids``, ``ignore_eos`` and ``min_tokens``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field, Tag, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from pdserve.common.generation import MAX_TOP_LOGPROBS
from pdserve.gateway.openai.responses_api.input_schemas import InputItem
from pdserve.gateway.openai.sampling_body import SharedSampling
from pdserve.gateway.openai.strict import OPEN, STRICT, TEXT_OR_LIST, type_tag
from pdserve.gateway.prepare.params import ReasoningEffort

OUTPUT_LOGPROBS = "message.output_text.logprobs"
"""The one ``include`` item pdserve reads: the message's text with its tokens' logprobs."""
MAX_METADATA_PAIRS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# NOTE: tools and formats are TypedDicts (plain dicts), as input items are
# (`pdserve.gateway.openai.responses_api.input_schemas`): they validate faster than models.


@with_config(STRICT)
class FunctionTool(TypedDict):
    """``{"type": "function", "name", "parameters", "strict", "description"}``: Responses' flat
    shape of chat's ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    name: str
    parameters: NotRequired[dict[str, Any] | None]
    strict: NotRequired[bool | None]
    description: NotRequired[str | None]


@with_config(OPEN)
class UnsupportedTool(TypedDict):
    """A built-in tool (web search, file search, ...): refused by name."""

    type: str


@with_config(STRICT)
class FunctionToolChoice(TypedDict):
    """``{"type": "function", "name"}``: call this function."""

    type: Literal["function"]
    name: str


@with_config(OPEN)
class UnsupportedToolChoice(TypedDict):
    """A tool_choice of any other type (a built-in tool, ``allowed_tools``): refused by name."""

    type: str


ToolChoiceValue = Annotated[
    Annotated[FunctionToolChoice, Tag("<function>")]
    | Annotated[UnsupportedToolChoice, Tag("<other>")],
    type_tag(frozenset({"function"})),
]

Tool = Annotated[
    Annotated[FunctionTool, Tag("<function>")] | Annotated[UnsupportedTool, Tag("<other>")],
    type_tag(frozenset({"function"})),
]


@with_config(STRICT)
class TextFormat(TypedDict):
    """``{"type": "text"}``: free text (the default)."""

    type: Literal["text"]


@with_config(STRICT)
class JsonObjectFormat(TypedDict):
    """``{"type": "json_object"}``: any JSON object."""

    type: Literal["json_object"]


@with_config(STRICT)
class JsonSchemaFormat(TypedDict):
    """``{"type": "json_schema", "name", "schema", "strict", "description"}``: JSON that
    matches ``schema``."""

    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema: dict[str, Any]
    strict: NotRequired[bool | None]
    description: NotRequired[str | None]


@with_config(STRICT)
class ReasoningConfig(TypedDict):
    """``reasoning``: the effort goes to the chat template as ``reasoning_effort`` (gpt-oss's
    reads it); the reasoning itself comes back as the output's reasoning item, whole, so no
    summary is written (``summary`` is accepted as null or ``auto`` only)."""

    effort: NotRequired[ReasoningEffort | None]
    summary: NotRequired[Literal["auto"] | None]


@with_config(STRICT)
class TextConfig(TypedDict):
    """``text``: the output's format."""

    format: NotRequired[
        Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]
    ]


class ResponsesRequest(SharedSampling):
    """Body of ``POST /v1/responses``."""

    input: Annotated[
        Annotated[str, Tag("<text>")] | Annotated[list[InputItem], Tag("<list>")], TEXT_OR_LIST
    ]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: TextConfig | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceValue | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    include: list[str] | None = None
    reasoning: ReasoningConfig | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None

    @property
    def wants_logprobs(self) -> bool:
        """``include`` asks for the output text's logprobs (``top_logprobs`` alternatives each;
        ``top_logprobs`` alone shows nothing, as OpenAI's)."""
        return OUTPUT_LOGPROBS in (self.include or ())

    @property
    def reasoning_effort(self) -> ReasoningEffort | None:
        """``reasoning.effort``, if set."""
        return self.reasoning.get("effort") if self.reasoning else None

    def refusal(self) -> tuple[str, str] | None:
        """The first parameter set to something pdserve does not implement, with why; None when
        there is none. Built-in tools, tool choices and input items are `convert`'s to refuse."""
        if self.conversation is not None:
            return "conversation", (
                "conversation objects are not supported: continue a conversation with "
                "previous_response_id, or send it whole as input items"
            )
        if self.background and self.store is False:
            return "store", "a background response is stored: store must be true"
        if self.prompt is not None:
            return "prompt", "prompt templates are not supported"
        for index, item in enumerate(self.include or ()):
            if item != OUTPUT_LOGPROBS:
                return f"include[{index}]", (
                    f"include {item[:64]!r} is not supported (only {OUTPUT_LOGPROBS!r})"
                )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            return "top_logprobs", f"top_logprobs must be 0 to {MAX_TOP_LOGPROBS}"
        if self.wants_logprobs and self.background:
            # NOTE: a background response is replayed from its tokens, which keep no logprobs.
            return "include", "a background response cannot return logprobs"
        if self.truncation not in (None, "disabled", "auto"):
            return "truncation", "truncation must be 'auto' or 'disabled'"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier", "service_tier is not supported"
        if self.tool_choice not in (None, "auto", "none") and not self.tools:
            return "tool_choice", "tool_choice needs tools"
        return self._metadata_refusal()

    def _metadata_refusal(self) -> tuple[str, str] | None:
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_PAIRS:
            return "metadata", f"metadata has at most {MAX_METADATA_PAIRS} pairs"
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                return "metadata", (
                    f"metadata keys have at most {MAX_METADATA_KEY_CHARS} characters and values "
                    f"at most {MAX_METADATA_VALUE_CHARS}"
                )
        return None
