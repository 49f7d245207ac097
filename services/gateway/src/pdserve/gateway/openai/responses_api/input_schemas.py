"""The input of ``POST /v1/responses``: its items (messages, function calls and their outputs,
reasoning) and their content parts, told apart by their ``type``; an item or part of a type
pdserve does not read parses as `UnsupportedItem` / `UnsupportedPart`, so the refusal can name
it (``input[2]``) instead of listing why it matched none of the known shapes."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Discriminator, Tag
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
OPEN = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

# NOTE: items and parts are TypedDicts (plain dicts), as chat messages are in
# `pdserve.gateway.openai.schemas`: they validate several times faster than models.


def type_tag(known: frozenset[str], default: str | None = None) -> Any:
    """A discriminator on ``type``: a known type's own shape, anything else ``<other>``.

    Tags are in angle brackets so that error locations can leave them out."""

    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else None
        return f"<{kind}>" if kind in known else "<other>"

    return Discriminator(tag)


def _text_or_list(value: Any) -> str:
    return "<text>" if isinstance(value, str) else "<list>"


# NOTE: a string or a list, told apart before validation, so an error in a list's item is
# reported alone rather than after "not a valid string".
TEXT_OR_LIST = Discriminator(_text_or_list)


class InputTextPart(TypedDict):
    """``{"type": "input_text", "text"}``: text the user (or system) wrote."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    type: Literal["input_text"]
    text: str


class OutputTextPart(TypedDict):
    """``{"type": "output_text", "text"}``: text of an earlier response, sent back as input
    (its annotations and logprobs are accepted and not read)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    type: Literal["output_text"]
    text: str
    annotations: NotRequired[list[Any]]
    logprobs: NotRequired[list[Any] | None]


class RefusalPart(TypedDict):
    """``{"type": "refusal", "refusal"}``: an earlier response's refusal, sent back as input."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    type: Literal["refusal"]
    refusal: str


class UnsupportedPart(TypedDict):
    """A content part of any other type (images, files, audio): refused by name."""

    __pydantic_config__ = OPEN  # type: ignore[misc]
    type: str


ContentPart = Annotated[
    Annotated[InputTextPart, Tag("<input_text>")]
    | Annotated[OutputTextPart, Tag("<output_text>")]
    | Annotated[RefusalPart, Tag("<refusal>")]
    | Annotated[UnsupportedPart, Tag("<other>")],
    type_tag(frozenset({"input_text", "output_text", "refusal"})),
]
Content = Annotated[
    Annotated[str, Tag("<text>")] | Annotated[list[ContentPart], Tag("<list>")], TEXT_OR_LIST
]


class MessageItem(TypedDict):
    """A message: ``{"role", "content"}`` (``type: "message"`` optional), content a string or
    a list of parts. An earlier response's output message (with ``id`` and ``status``) is one
    too."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    type: NotRequired[Literal["message"]]
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: NotRequired[str]
    status: NotRequired[Literal["in_progress", "completed", "incomplete"]]
    phase: NotRequired[str | None]


class FunctionCallItem(TypedDict):
    """A function call the model made earlier (``type: "function_call"``)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: NotRequired[str]
    status: NotRequired[Literal["in_progress", "completed", "incomplete"]]


class FunctionCallOutputItem(TypedDict):
    """What a function call returned (``type: "function_call_output"``)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    type: Literal["function_call_output"]
    call_id: str
    output: Content
    id: NotRequired[str | None]
    status: NotRequired[Literal["in_progress", "completed", "incomplete"] | None]


class ReasoningTextPart(TypedDict):
    """``{"type": "reasoning_text", "text"}``: reasoning of an earlier response."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    type: Literal["reasoning_text"]
    text: str


class SummaryTextPart(TypedDict):
    """``{"type": "summary_text", "text"}``: a summary of an earlier response's reasoning."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    type: Literal["summary_text"]
    text: str


class ReasoningItem(TypedDict):
    """Reasoning the model wrote earlier (``type: "reasoning"``), as a response's output gives
    it back: its text in ``content`` (pdserve's), or only a ``summary``. Encrypted reasoning
    (``encrypted_content``) cannot be read here and is refused."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    type: Literal["reasoning"]
    summary: list[SummaryTextPart]
    content: NotRequired[list[ReasoningTextPart] | None]
    encrypted_content: NotRequired[str | None]
    id: NotRequired[str]
    status: NotRequired[Literal["in_progress", "completed", "incomplete"] | None]


class UnsupportedItem(TypedDict):
    """An input item of any other type (item references, built-in tool calls): refused by
    name."""

    __pydantic_config__ = OPEN  # type: ignore[misc]
    type: str


InputItem = Annotated[
    Annotated[MessageItem, Tag("<message>")]
    | Annotated[FunctionCallItem, Tag("<function_call>")]
    | Annotated[FunctionCallOutputItem, Tag("<function_call_output>")]
    | Annotated[ReasoningItem, Tag("<reasoning>")]
    | Annotated[UnsupportedItem, Tag("<other>")],
    type_tag(
        frozenset({"message", "function_call", "function_call_output", "reasoning"}),
        default="message",
    ),
]
