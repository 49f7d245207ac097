"""Reasoning read out of a chat completion's deltas (`pdserve.gateway.reasoning`)."""

from __future__ import annotations

import pytest

from pdserve.common.generation import FinishReason
from pdserve.gateway.reasoning import (
    ReasoningStream,
    prompt_opens_thinking,
    uses_think_blocks,
)
from pdserve.gateway.request import OutputDelta


def split(pieces: list[str], is_open: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, per delta) of `pieces` streamed one by one, the last finishing."""
    stream = ReasoningStream(is_open)
    steps = []
    for index, piece in enumerate(pieces):
        last = index == len(pieces) - 1
        delta = OutputDelta(piece, (), index, FinishReason.STOP if last else None)
        out = stream.step(delta)
        steps.append((out.reasoning, out.text))
    return "".join(r for r, _ in steps), "".join(t for _, t in steps), steps


@pytest.mark.parametrize(
    "pieces",
    [
        ["<think>why not</think>\n\nyes"],
        ["<th", "ink>why ", "not</th", "ink>", "\n", "\nyes"],
        list("<think>why not</think>\n\nyes"),
    ],
)
def test_a_completion_that_starts_a_think_block_splits_wherever_the_deltas_cut(
    pieces: list[str],
) -> None:
    reasoning, content, _ = split(pieces)
    assert (reasoning, content) == ("why not", "yes")


def test_a_prompt_that_opens_the_block_makes_the_first_text_reasoning() -> None:
    assert split(["because", " it is</think>", "done"], is_open=True)[:2] == (
        "because it is",
        "done",
    )


def test_without_a_think_block_everything_is_content_and_markers_later_stay_content() -> None:
    assert split(["plain ", "answer <think>x</think>"])[:2] == ("", "plain answer <think>x</think>")
    assert split(["<", "b>bold</b>"])[:2] == ("", "<b>bold</b>")


def test_a_completion_cut_before_the_end_is_all_reasoning_with_nothing_held() -> None:
    reasoning, content, steps = split(["<think>half a thou", "ght </thi"])
    assert (reasoning, content) == ("half a thought </thi", "")
    # NOTE: what may begin the end marker waits for the next delta, then goes out.
    assert steps[0] == ("half a thou", "")


def test_which_requests_are_read_and_which_prompts_open_a_block() -> None:
    assert uses_think_blocks("think", None)
    assert not uses_think_blocks("none", "{{ '</think>' }}")
    assert uses_think_blocks("auto", "{% if x %}</think>{% endif %}")
    assert not uses_think_blocks("auto", "{{ messages }}")
    assert prompt_opens_thinking("<|Assistant|><think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
