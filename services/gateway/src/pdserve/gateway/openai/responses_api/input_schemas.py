"""The input of ``POST /v1/responses``: its items (messages, function calls and their outputs,
reasoning) and their content parts, told apart by their ``type``; an item or part of a type
pdserve does not read parses as `UnsupportedItem` / `UnsupportedPart`, so the refusal can name
it (``input[2]``) instead of listing why it matched none of the known shapes."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Tag, with_config
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from pdserve.gateway.openai.strict import OPEN, STRICT, TEXT_OR_LIST, UnsupportedPart, type_tag


@with_config(STRICT)
class InputTextPart(TypedDict):
    """``{"type": "input_text", "text"}``: text the user (or system) wrote."""

    type: Literal["input_text"]
    text: str


@with_config(STRICT)
class OutputTextPart(TypedDict):
    """``{"type": "output_text", "text"}``: text of an earlier response, sent back as input
    (its annotations and logprobs are accepted and not read)."""

    type: Literal["output_text"]
    text: str
    annotations: NotRequired[list[Any]]
    logprobs: NotRequired[list[Any] | None]


@with_config(STRICT)
class RefusalPart(TypedDict):
    """``{"type": "refusal", "refusal"}``: an earlier response's refusal, sent back as input."""

    type: Literal["refusal"]
    refusal: str


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


@with_config(STRICT)
class MessageItem(TypedDict):
    """A message: ``{"role", "content"}`` (``type: "message"`` optional), content a string or
    a list of parts. An earlier response's output message (with ``id`` and ``status``) is one
    too."""

    type: NotRequired[Literal["message"]]
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: NotRequired[str]
    status: NotRequired[Literal["in_progress", "completed", "incomplete"]]
    phase: NotRequired[str | None]


@with_config(STRICT)
class FunctionCallItem(TypedDict):
    """A function call the model made earlier (``type: "function_call"``)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: NotRequired[str]
    status: NotRequired[Literal["in_progress", "completed", "incomplete"]]


@with_config(STRICT)
class FunctionCallOutputItem(TypedDict):
    """What a function call returned (``type: "function_call_output"``)."""

    type: Literal["function_call_output"]
    call_id: str
    output: Content
    id: NotRequired[str | None]
    status: NotRequired[Literal["in_progress", "completed", "incomplete"] | None]


@with_config(STRICT)
class ReasoningTextPart(TypedDict):
    """``{"type": "reasoning_text", "text"}``: reasoning of an earlier response."""

    type: Literal["reasoning_text"]
    text: str


@with_config(STRICT)
class SummaryTextPart(TypedDict):
    """``{"type": "summary_text", "text"}``: a summary of an earlier response's reasoning."""

    type: Literal["summary_text"]
    text: str


@with_config(STRICT)
class ReasoningItem(TypedDict):
    """Reasoning the model wrote earlier (``type: "reasoning"``), as a response's output gives
    it back: its text in ``content`` (pdserve's), or only a ``summary``. Encrypted reasoning
    (``encrypted_content``) cannot be read here and is refused."""

    type: Literal["reasoning"]
    summary: list[SummaryTextPart]
    content: NotRequired[list[ReasoningTextPart] | None]
    encrypted_content: NotRequired[str | None]
    id: NotRequired[str]
    status: NotRequired[Literal["in_progress", "completed", "incomplete"] | None]


@with_config(OPEN)
class UnsupportedItem(TypedDict):
    """An input item of any other type (item references, built-in tool calls): refused by
    name."""

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
