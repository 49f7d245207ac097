"""A chat completion's reasoning read out of its text: what a thinking model writes between
``<think>`` and ``</think>`` (Qwen3, DeepSeek-R1 and the models trained like them) goes to
``reasoning_content``, the rest to ``content``, streamed as it comes (as vLLM's reasoning
parsers do).

The reasoning is open from the first token when the prompt ends inside a think block (a
template that opens it for the model, as DeepSeek-R1's), or when the completion starts with
``<think>`` (Qwen3); otherwise the completion is all content. It ends at ``</think>``; the
blank lines after it are dropped. A completion cut off before ``</think>`` is all reasoning.
Text that may be the start of a marker is held back until the next delta says.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pdserve.gateway.request import OutputDelta
from pdserve.tokenizer.stop import partial_tail

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("auto", "none", "think")


def uses_think_blocks(parser: str, chat_template: str | None) -> bool:
    """Whether chat completions are read for reasoning: ``think`` always, ``auto`` when the
    model's chat template knows ``</think>``, ``none`` never."""
    if parser == "think":
        return True
    return parser == "auto" and bool(chat_template) and THINK_END in (chat_template or "")


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside a think block (its template opened one)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_START)


class ReasoningStream:
    """One choice's text split into reasoning and content, delta by delta.

    Args:
        is_open: The prompt ends inside a think block.
    """

    def __init__(self, is_open: bool) -> None:
        self._state = "reasoning" if is_open else "start"
        self._held = ""
        self._after_end = False  # drop the blank lines after </think>

    def step(self, delta: OutputDelta) -> OutputDelta:
        """The delta with its text split into `reasoning` and `text` (content)."""
        is_last = delta.finish_reason is not None
        reasoning, content = self._feed(self._held + delta.text, is_last)
        return replace(delta, text=content, reasoning=reasoning)

    def _feed(self, text: str, is_last: bool) -> tuple[str, str]:
        self._held = ""
        if self._state == "start":
            if text.startswith(THINK_START):
                self._state = "reasoning"
                text = text[len(THINK_START) :]
            elif THINK_START.startswith(text) and not is_last:
                self._held = text
                return "", ""
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = text.find(THINK_END)
            if end < 0:
                keep = 0 if is_last else partial_tail(text, (THINK_END,))
                self._held = text[len(text) - keep :] if keep else ""
                return text[: len(text) - keep], ""
            self._state = "content"
            self._after_end = True
            reasoning, text = text[:end], text[end + len(THINK_END) :]
            return reasoning, self._content(text, is_last)
        return "", self._content(text, is_last)

    def _content(self, text: str, is_last: bool) -> str:
        if self._after_end:
            text = text.lstrip("\n")
            if not text and not is_last:
                return ""
            self._after_end = False
        return text


def joined(deltas: Sequence[OutputDelta]) -> str:
    """The whole reasoning of a choice's deltas."""
    return "".join(d.reasoning for d in deltas)
