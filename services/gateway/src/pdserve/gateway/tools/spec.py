"""What a request says about tools, in the gateway's own terms: the functions it offers, how
the model may use them, the calls in its history, and the calls read from a completion.

Plain data only: both front ends build these, the validator checks them
(`pdserve.gateway.prepare.messages`), and nothing here knows about HTTP or protobuf.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

TOOL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


class ToolChoiceMode(enum.Enum):
    """OpenAI's ``tool_choice``: whether the model may, or must, call a tool."""

    NONE = "none"  # text only; the output is not read for calls
    AUTO = "auto"  # text or calls, read by the tool-call parser
    REQUIRED = "required"  # at least one call, forced by a constraint
    FUNCTION = "function"  # one call of the named function, forced by a constraint


@dataclass(frozen=True)
class ToolChoice:
    """A request's ``tool_choice``; `function_name` is set for FUNCTION only."""

    mode: ToolChoiceMode
    function_name: str | None = None


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call.

    Attributes:
        name: Its name (`TOOL_NAME_PATTERN`, unique in a request).
        description: What it does, for the model.
        parameters: The JSON Schema of its arguments as JSON text; None: not given.
        strict: OpenAI's ``strict`` flag as the client sent it (shown to the template only).
    """

    name: str
    description: str | None = None
    parameters: str | None = None
    strict: bool | None = None

    def parameters_schema(self) -> dict[str, Any]:
        """The arguments' schema (any object when none was given).

        Raises:
            ValueError: If `parameters` is not the JSON text of an object.
        """
        if self.parameters is None:
            return {"type": "object"}
        schema = json.loads(self.parameters)
        if not isinstance(schema, dict):
            raise ValueError("parameters must be a JSON object")
        return schema

    def to_template(self) -> dict[str, Any]:
        """The tool as the chat template sees it: OpenAI's shape, with the fields given."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = json.loads(self.parameters)
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call in a conversation's history (an assistant message's ``tool_calls``).

    Attributes:
        id: Its id, which a later tool message names.
        name: The function called.
        arguments: The arguments' JSON text, as the model wrote them.
    """

    id: str
    name: str
    arguments: str

    def to_template(self) -> dict[str, Any]:
        """The call as the chat template sees it: arguments as a mapping (what transformers'
        templates expect), or the text itself when it is not a JSON object."""
        arguments: Any = self.arguments
        try:
            parsed = json.loads(self.arguments)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            arguments = parsed
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


@dataclass(frozen=True)
class ToolCallDelta:
    """A step of one call read from a completion.

    Attributes:
        index: Which call of the completion (0, 1, ...).
        id: The call's id (its first delta only).
        name: The function's name (its first delta only).
        arguments: The next piece of the arguments' JSON text.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
