"""`merged`: the choices of one request as one stream of indexed deltas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import SamplingParams
from pdserve.gateway.choices import merged
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import GenerationRequest, OutputDelta


class Choice:
    """A fake choice stream that records when it started and whether it was closed."""

    def __init__(self, log: list[str], name: str, texts: list[str], fail: bool = False) -> None:
        self.log, self.name, self.texts, self.fail = log, name, texts, fail
        self.closed = False

    async def stream(self) -> AsyncGenerator[tuple[int, OutputDelta], None]:
        self.log.append(f"start {self.name}")
        try:
            for index, text in enumerate(self.texts):
                await asyncio.sleep(0.01)
                yield 0, OutputDelta(text, (index,), index)
            if self.fail:
                raise PdserveError(ErrorReason.INTERNAL, f"{self.name} broke")
            await asyncio.sleep(1.0 if self.name == "slow" else 0)
        finally:
            self.closed = True


async def test_every_delta_arrives_tagged_with_its_choice() -> None:
    log: list[str] = []
    choices = [Choice(log, str(i), [f"{i}a", f"{i}b"]) for i in range(4)]
    got = [(i, d.text) async for i, d in merged([c.stream() for c in choices], n=2)]
    for i in range(4):
        assert [text for index, text in got if index == i] == [f"{i}a", f"{i}b"]
    assert all(c.closed for c in choices)


async def test_a_single_choice_is_its_own_stream_with_no_layer_between() -> None:
    stream = Choice([], "only", ["a", "b"]).stream()
    assert merged([stream]) is stream


async def test_a_prompts_other_choices_start_after_its_first_delta() -> None:
    log: list[str] = []
    choices = [Choice(log, f"p{p}c{c}", ["x", "y"]) for p in range(2) for c in range(2)]
    stream = merged([c.stream() for c in choices], n=2)
    first = await anext(stream)
    assert first[0] in (0, 2)  # a prompt's first choice
    remaining = [item async for item in stream]
    assert len(remaining) == 7
    # each prompt's second choice started only after its first choice had output
    for p in range(2):
        assert log.index(f"start p{p}c1") > log.index(f"start p{p}c0")
    assert sorted(log[:2]) == ["start p0c0", "start p1c0"]  # both prompts' first choices


async def test_one_choices_error_ends_the_stream_and_closes_the_others() -> None:
    log: list[str] = []
    ok, slow, broken = (
        Choice(log, "ok", ["a"]),
        Choice(log, "slow", ["b"]),
        Choice(log, "broken", ["c"], fail=True),
    )
    with pytest.raises(PdserveError, match="broken broke"):
        async for _ in merged([ok.stream(), slow.stream(), broken.stream()]):
            pass
    assert slow.closed and broken.closed


async def test_closing_early_closes_every_choice() -> None:
    log: list[str] = []
    choices = [Choice(log, "slow", ["a", "b"]) for _ in range(3)]
    stream = merged([c.stream() for c in choices])
    await anext(stream)
    await stream.aclose()
    assert all(c.closed for c in choices)


def test_the_choices_of_one_prompt_share_a_key_that_names_the_prompt() -> None:
    def prepared(request_id: str, prompt: tuple[int, ...], n: int) -> PreparedRequest:
        request = GenerationRequest(request_id, "m", prompt, SamplingParams(seed=5))
        return PreparedRequest(request, (), tokenizer=None, n=n)  # type: ignore[arg-type]

    choices = prepared("r", (1, 2, 3), 3).choices()
    assert [c.request_id for c in choices] == ["r-0", "r-1", "r-2"]
    assert [c.request.sampling.seed for c in choices] == [5, 6, 7]
    keys = {c.request.share_key for c in choices}
    assert len(keys) == 1 and keys.pop().startswith("r:")
    assert prepared("r", (1, 2, 3), 1).choices()[0].request.share_key == ""  # nothing to share
    other_prompt = prepared("r", (1, 2, 4), 2).choices()[0].request.share_key
    assert other_prompt != choices[0].request.share_key
