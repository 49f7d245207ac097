"""What a client asks for, in the gateway's own terms, and its validation and tokenization.

Front ends (REST, gRPC) turn their requests into `GenerationParams`; `check_sampling` and
`tokenize_prompt` reject anything wrong with a typed INVALID_REQUEST before work starts.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.request import FinishReason, GenerationRequest, Usage
from pdserve.tokenizer import ChatTemplateError, Tokenizer

MAX_SEED = 2**63
CHAT_ROLES = ("system", "user", "assistant")


class PromptKind(enum.Enum):
    """Which API a request came through (decides the default max_tokens and the trace's
    ``gen_ai.operation.name``)."""

    COMPLETION = "completion"
    CHAT = "chat"


@dataclass(frozen=True)
class ChatMessage:
    """One chat message."""

    role: str
    content: str


@dataclass(frozen=True)
class GenerationParams:
    """A generation request as a front end parsed it, not yet validated.

    Exactly one of `text`, `token_ids` and `messages` is set. Unset sampling fields (None)
    take the model's defaults; `max_tokens` None takes the API's default.
    """

    model: str
    kind: PromptKind
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    client_request_id: str | None = None
    user: str | None = None


@dataclass(frozen=True)
class PreparedRequest:
    """A validated, tokenized request, ready to stream."""

    request: GenerationRequest
    stop: tuple[str, ...]
    tokenizer: Tokenizer
    client_request_id: str | None = None
    user: str | None = None
    kind: PromptKind = PromptKind.COMPLETION

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids


@dataclass(frozen=True)
class OutputDelta:
    """One step of a completion stream.

    Attributes:
        text: New text (may lag `token_ids`).
        token_ids: New completion tokens.
        first_index: Completion index of ``token_ids[0]`` (or the token count so far).
        finish_reason: Set on the last delta only.
        usage: Set on the last delta only.
    """

    text: str
    token_ids: tuple[int, ...]
    first_index: int
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class ModelSummary:
    """A served model with at least one compatible prefill/decode pair."""

    name: str
    max_model_len: int
    num_prefill_instances: int
    num_decode_instances: int


def invalid(message: str, param: str) -> PdserveError:
    return PdserveError(ErrorReason.INVALID_REQUEST, message, {"param": param})


def check_sampling(params: GenerationParams) -> None:
    if params.max_tokens is not None and params.max_tokens < 1:
        raise invalid(f"max_tokens must be >= 1, got {params.max_tokens}", "max_tokens")
    if params.temperature is not None and not (
        math.isfinite(params.temperature) and params.temperature >= 0
    ):
        raise invalid(f"temperature must be >= 0, got {params.temperature}", "temperature")
    if params.top_p is not None and not 0 < params.top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {params.top_p}", "top_p")
    if params.top_k is not None and params.top_k < 0:
        raise invalid(f"top_k must be >= 0 (0 disables it), got {params.top_k}", "top_k")
    if params.seed is not None and not 0 <= params.seed < MAX_SEED:
        raise invalid(f"seed must be in [0, 2**63), got {params.seed}", "seed")
    if any(not stop for stop in params.stop):
        raise invalid("stop strings must not be empty", "stop")
    if any(token_id < 0 for token_id in params.stop_token_ids):
        raise invalid("stop_token_ids must be >= 0", "stop_token_ids")
    num_inputs = sum(x is not None for x in (params.text, params.token_ids, params.messages))
    if num_inputs != 1:
        raise invalid("exactly one of a text prompt, token ids or messages is required", "prompt")


def tokenize_prompt(params: GenerationParams, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: chat messages through the template, text through the tokenizer.

    Raises:
        PdserveError: INVALID_REQUEST for unknown roles, an unrenderable chat or an empty prompt.
    """
    if params.messages is not None:
        if not params.messages:
            raise invalid("messages must not be empty", "messages")
        for index, message in enumerate(params.messages):
            if message.role not in CHAT_ROLES:
                raise invalid(
                    f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}",
                    "messages",
                )
        messages = [{"role": m.role, "content": m.content} for m in params.messages]
        try:
            token_ids = tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise invalid(f"messages cannot be rendered: {exc}", "messages") from exc
    elif params.token_ids is not None:
        token_ids = list(params.token_ids)
    else:
        token_ids = tokenizer.encode(params.text or "")
    if not token_ids:
        raise invalid("the prompt is empty", "prompt")
    return token_ids
