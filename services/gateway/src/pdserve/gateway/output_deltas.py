"""A completion's tokens as `OutputDelta`s: text through `CompletionText` (with the stop
strings), one delta per token where a stream can be resumed, a final delta with the text held
back, the finish reason and the usage; and a finished resumable request's deltas made again
from its tokens (`replay`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

from pdserve.common.generation import FinishReason
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.reasoning import ReasoningStream
from pdserve.gateway.request import GenerationEnd, OutputDelta, TokenChunk, Usage
from pdserve.gateway.text import CompletionText
from pdserve.gateway.tool_deltas import with_tool_calls


def replay(
    prepared: PreparedRequest, token_ids: Sequence[int], end: GenerationEnd
) -> AsyncGenerator[OutputDelta, None]:
    """The deltas a resumable request's stream had, made again from its tokens and its end
    (as `Streamer.stream` makes them: one token each, then the final delta)."""
    deltas = _replayed(prepared, token_ids, end)
    if prepared.reasoning_opens is not None:
        deltas = with_reasoning(deltas, prepared.reasoning_opens)
    if prepared.tool_plan is None:
        return deltas
    return with_tool_calls(deltas, prepared.tool_plan, prepared.request_id)


async def with_reasoning(
    deltas: AsyncGenerator[OutputDelta, None], is_open: bool
) -> AsyncGenerator[OutputDelta, None]:
    """One choice's deltas with its reasoning read out (`pdserve.gateway.reasoning`)."""
    stream = ReasoningStream(is_open)
    try:
        async for delta in deltas:
            yield stream.step(delta)
    finally:
        await deltas.aclose()


async def _replayed(
    prepared: PreparedRequest, token_ids: Sequence[int], end: GenerationEnd
) -> AsyncGenerator[OutputDelta, None]:
    text = prepared.completion_text()
    if token_ids:
        for delta in text_deltas(text, TokenChunk(tuple(token_ids), 0), one_by_one=True):
            yield delta
    yield final_delta(prepared, text, end)


def text_deltas(text: CompletionText, chunk: TokenChunk, one_by_one: bool) -> list[OutputDelta]:
    """The deltas of `chunk`'s tokens (one per token with `one_by_one`), up to a stop string."""
    deltas = []
    for piece in single_token_chunks(chunk) if one_by_one else (chunk,):
        step = text.add(piece.token_ids)
        if step.text or step.token_ids or piece.prompt_logprobs:
            deltas.append(
                OutputDelta(
                    step.text,
                    step.token_ids,
                    piece.first_index,
                    logprobs=piece.logprobs[: len(step.token_ids)],
                    prompt_logprobs=piece.prompt_logprobs,
                )
            )
        if step.is_stopped:
            break
    return deltas


def final_delta(
    prepared: PreparedRequest, text: CompletionText, end: GenerationEnd | None
) -> OutputDelta:
    """The last delta: the text held back, the finish reason and the usage."""
    finish_reason = FinishReason.STOP if text.is_stopped or end is None else end.finish_reason
    if prepared.is_prompt_only:
        finish_reason = FinishReason.LENGTH
    usage = Usage(
        num_prompt_tokens=len(prepared.request.prompt_token_ids),
        num_completion_tokens=text.num_tokens,
        num_cached_prompt_tokens=end.num_cached_prompt_tokens if end else 0,
    )
    return OutputDelta(text.finish(), (), text.num_tokens, finish_reason, usage)


def single_token_chunks(chunk: TokenChunk) -> list[TokenChunk]:
    """`chunk` as chunks of one token each (the prompt's logprobs on the first)."""
    return [
        TokenChunk(
            (token_id,),
            chunk.first_index + offset,
            chunk.logprobs[offset : offset + 1],
            chunk.prompt_logprobs if offset == 0 else (),
        )
        for offset, token_id in enumerate(chunk.token_ids)
    ]
