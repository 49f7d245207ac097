"""A prepared prompt's token ids: chat messages (and tools) through the model's chat template,
text through its tokenizer; short prompts on the event loop, long ones on a worker thread."""

from __future__ import annotations

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.gateway.prepare.params import GenerationParams
from pdserve.gateway.prepare.tool_prompt import template_inputs
from pdserve.gateway.tools.formats import ToolCallFormat
from pdserve.tokenizer import ChatTemplateError, Tokenizer

# NOTE: tokenizing 1024 characters takes a fraction of a millisecond; a hop to a worker thread
# and back costs more than that under load (the loop waits to get the GIL back), all of it time
# to first token.
INLINE_TOKENIZE_CHARS = 1024
INLINE_TOKENIZE_MESSAGES = 16


def is_short_prompt(params: GenerationParams) -> bool:
    """Whether the prompt is short enough to tokenize on the event loop."""
    if params.messages is not None:
        return (
            len(params.messages) <= INLINE_TOKENIZE_MESSAGES
            and sum(m.num_chars for m in params.messages) + params.num_tool_chars
            <= INLINE_TOKENIZE_CHARS
        )
    return len(params.text or "") <= INLINE_TOKENIZE_CHARS


def tokenize_prompt(
    params: GenerationParams, tokenizer: Tokenizer, call_format: ToolCallFormat
) -> list[int]:
    """The prompt's token ids: chat messages (and tools) through the template, text through the
    tokenizer.

    Heavy for long prompts: the front end runs those on a worker thread.

    Args:
        params: The validated request.
        tokenizer: The model's.
        call_format: The model's tool-call format, for what its template does not render
            (`pdserve.gateway.prepare.tool_prompt`).

    Raises:
        PdserveError: INVALID_REQUEST for a chat the template refuses, or an empty prompt.
    """
    if params.messages is not None:
        try:
            messages, tools = template_inputs(
                params.messages, params.tools, call_format, tokenizer.tool_support
            )
            token_ids = tokenizer.encode_chat(
                messages,
                params.add_generation_prompt,
                continue_final_message=params.continue_final_message,
                tools=tools,
                **dict(params.template_variables),
            )
        except ChatTemplateError as exc:
            raise PdserveError(
                ErrorReason.INVALID_REQUEST,
                f"messages cannot be rendered: {exc}",
                {"param": "messages"},
            ) from exc
    elif params.token_ids is not None:
        token_ids = list(params.token_ids)
    else:
        token_ids = tokenizer.encode(params.text or "")
    if not token_ids:
        raise PdserveError(ErrorReason.INVALID_REQUEST, "the prompt is empty", {"param": "prompt"})
    return token_ids
