"""The openai SDK's model of each Responses API streaming event, by its ``type``: tests
validate every event a gateway sends against it."""

from __future__ import annotations

import pydantic
from openai.types import responses as sdk

SDK_EVENTS: dict[str, type[pydantic.BaseModel]] = {
    "response.created": sdk.ResponseCreatedEvent,
    "response.in_progress": sdk.ResponseInProgressEvent,
    "response.output_item.added": sdk.ResponseOutputItemAddedEvent,
    "response.content_part.added": sdk.ResponseContentPartAddedEvent,
    "response.output_text.delta": sdk.ResponseTextDeltaEvent,
    "response.output_text.done": sdk.ResponseTextDoneEvent,
    "response.content_part.done": sdk.ResponseContentPartDoneEvent,
    "response.function_call_arguments.delta": sdk.ResponseFunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": sdk.ResponseFunctionCallArgumentsDoneEvent,
    "response.output_item.done": sdk.ResponseOutputItemDoneEvent,
    "response.completed": sdk.ResponseCompletedEvent,
    "response.incomplete": sdk.ResponseIncompleteEvent,
}
