"""Exactly-once token delivery by completion index, and completion text with stop strings."""

from __future__ import annotations

import pytest
from support.gateway_fakes import EOS_TOKEN_ID, TOKENIZER_CONFIG, TOKENIZER_JSON

from pdserve.common.generation import FinishReason, SamplingParams
from pdserve.gateway.progress import CompletionProgress
from pdserve.gateway.request import GenerationRequest
from pdserve.gateway.text import CompletionText
from pdserve.tokenizer import Tokenizer


def _request(max_tokens: int = 10, stop_token_ids: tuple[int, ...] = ()) -> GenerationRequest:
    return GenerationRequest(
        request_id="r",
        model="tiny",
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(seed=1, max_tokens=max_tokens, stop_token_ids=stop_token_ids),
        eos_token_ids=(EOS_TOKEN_ID,),
    )


def test_resent_tokens_are_dropped_and_new_ones_kept() -> None:
    progress = CompletionProgress(_request())
    assert progress.accept([10], 0).chunk is not None
    assert progress.accept([11, 12], 1).chunk.token_ids == (11, 12)  # type: ignore[union-attr]
    # A continuation resends index 2 and adds 3, 4.
    accepted = progress.accept([12, 13, 14], 2)
    assert accepted.chunk is not None
    assert (accepted.chunk.token_ids, accepted.chunk.first_index) == ((13, 14), 3)
    assert progress.accept([10, 11], 0).chunk is None
    assert progress.token_ids == (10, 11, 12, 13, 14)
    assert progress.continuation_token_ids() == (1, 2, 3, 10, 11, 12, 13, 14)
    assert progress.num_mismatches == 0
    progress.accept([99], 0)
    assert progress.num_mismatches == 1 and progress.token_ids[0] == 10


def test_a_gap_is_reported_and_nothing_past_it_accepted() -> None:
    progress = CompletionProgress(_request())
    progress.accept([10, 11], 0)
    accepted = progress.accept([20, 21], 3)
    assert accepted.has_gap and accepted.chunk is None
    assert progress.num_tokens == 2


@pytest.mark.parametrize(
    ("tokens", "request_", "num_kept", "reason"),
    [
        ([5, 6, 7, 8], _request(max_tokens=3), 3, FinishReason.LENGTH),
        ([5, 42, 7], _request(stop_token_ids=(42,)), 2, FinishReason.STOP),
        ([5, EOS_TOKEN_ID, 7], _request(), 2, FinishReason.STOP),
    ],
)
def test_the_end_is_detected_and_later_tokens_ignored(
    tokens: list[int], request_: GenerationRequest, num_kept: int, reason: FinishReason
) -> None:
    progress = CompletionProgress(request_)
    progress.accept(tokens, 0)
    assert progress.num_tokens == num_kept
    assert progress.finish_reason is reason
    assert progress.accept([1], num_kept).chunk is None


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_files(TOKENIZER_JSON, TOKENIZER_CONFIG)


def test_stop_string_split_over_tokens_cuts_text_and_tokens(tokenizer: Tokenizer) -> None:
    text = CompletionText(tokenizer, [104, 105], stop=["STOP"])
    steps = [text.add(list(b"ab ST")), text.add(list(b"O")), text.add(list(b"Pxyz"))]
    assert "".join(step.text for step in steps) == "ab "
    assert steps[2].is_stopped and steps[2].token_ids == (ord("P"),)
    assert text.num_tokens == len("ab STOP")
    assert text.finish() == ""
    with pytest.raises(RuntimeError):
        text.add([1])


def test_multibyte_character_is_held_until_complete(tokenizer: Tokenizer) -> None:
    text = CompletionText(tokenizer, [])
    encoded = "é!".encode()
    assert text.add([encoded[0]]).text == ""
    assert text.add(list(encoded[1:])).text == "é!"
    assert text.add([EOS_TOKEN_ID]).text == ""  # special tokens are not text
    assert text.finish() == ""
