"""The request vocabulary every service shares: the stop rule, the seed rule, block counts,
and the one mapping of sampling settings and finish reasons to and from the contract."""

from __future__ import annotations

import random

import pytest

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import (
    DEFAULT_SEED,
    FinishReason,
    SamplingParams,
    check_stop,
    num_blocks_for,
    resolve_seed,
)
from pdserve.serving.convert import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    sampling_from_proto,
    sampling_to_proto,
)
from pdserve.v1 import common_pb2

EOS = (2, 7)
STOP_AT_9 = SamplingParams(max_tokens=4, stop_token_ids=(9,))


@pytest.mark.parametrize(
    ("token_id", "num_output_tokens", "sampling", "num_tokens", "max_model_len", "expected"),
    [
        (5, 1, STOP_AT_9, 6, None, None),
        (9, 1, STOP_AT_9, 6, None, FinishReason.STOP),  # a stop id
        (7, 1, STOP_AT_9, 6, None, FinishReason.STOP),  # an end-of-sequence id
        (7, 1, SamplingParams(max_tokens=4, ignore_eos=True), 6, None, None),
        (
            9,
            1,
            SamplingParams(max_tokens=4, stop_token_ids=(9,), ignore_eos=True),
            6,
            None,
            FinishReason.STOP,
        ),  # ignore_eos leaves stop ids alone
        (5, 4, STOP_AT_9, 9, None, FinishReason.LENGTH),  # max_tokens
        (9, 4, STOP_AT_9, 9, None, FinishReason.STOP),  # a stop id wins over max_tokens
        (5, 2, STOP_AT_9, 10, 10, FinishReason.LENGTH),  # the model's length
        (5, 2, STOP_AT_9, 9, 10, None),
        (9, 0, STOP_AT_9, 5, None, None),  # the prompt's last token never stops
        (5, 4, STOP_AT_9, 5, None, FinishReason.LENGTH),  # resumed with max_tokens reached
    ],
)
def test_stop_rule(
    token_id: int,
    num_output_tokens: int,
    sampling: SamplingParams,
    num_tokens: int,
    max_model_len: int | None,
    expected: FinishReason | None,
) -> None:
    reason = check_stop(
        token_id,
        num_output_tokens,
        sampling,
        EOS,
        num_tokens=num_tokens,
        max_model_len=max_model_len,
    )
    assert reason is expected


def test_a_given_seed_is_kept_and_a_missing_one_is_drawn_or_the_default() -> None:
    assert resolve_seed(123, random.Random(0)) == 123
    assert resolve_seed(None) == DEFAULT_SEED
    drawn = [resolve_seed(None, random.Random(5)) for _ in range(2)]
    assert drawn[0] == drawn[1]  # a seeded source draws reproducibly
    assert 0 <= drawn[0] < 2**63
    SamplingParams(seed=drawn[0])  # a drawn seed is a valid one


@pytest.mark.parametrize(
    ("num_tokens", "expected"), [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (33, 3)]
)
def test_blocks_for_tokens(num_tokens: int, expected: int) -> None:
    assert num_blocks_for(num_tokens, 16) == expected


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": -0.5},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_tokens": 0},
        {"seed": 2**63},
        {"stop_token_ids": (3, -1)},
    ],
)
def test_out_of_range_settings_are_refused(changes: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(changes))):
        SamplingParams(**changes)  # type: ignore[arg-type]


def test_sampling_round_trips_through_the_contract() -> None:
    params = SamplingParams(
        temperature=0.5,
        top_k=40,
        top_p=0.75,
        seed=2**62 + 1,
        max_tokens=33,
        stop_token_ids=(4, 5),
        ignore_eos=True,
        allowed_token_ids=(9, 3),
        bad_words=((7, 8), (6,)),
    )
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert params.allowed_token_ids == (3, 9) and params.has_token_filters
    seedless = SamplingParams(temperature=0.0, max_tokens=3)
    assert not sampling_to_proto(seedless).HasField("seed")
    assert sampling_from_proto(sampling_to_proto(seedless)) == seedless


def test_unset_contract_fields_take_the_defaults_and_bad_ones_are_invalid() -> None:
    parsed = sampling_from_proto(common_pb2.SamplingParams(max_tokens=8, seed=2**64 - 1))
    assert parsed == SamplingParams(max_tokens=8, seed=(2**64 - 1) % 2**63)
    with pytest.raises(PdserveError) as caught:
        sampling_from_proto(common_pb2.SamplingParams(max_tokens=0))
    assert caught.value.reason is ErrorReason.INVALID_REQUEST


def test_finish_reasons_map_to_the_contract_and_back() -> None:
    for reason in (FinishReason.STOP, FinishReason.LENGTH):
        assert finish_reason_from_proto(finish_reason_to_proto(reason)) is reason
    assert finish_reason_from_proto(common_pb2.FINISH_REASON_UNSPECIFIED) is None
    with pytest.raises(ValueError, match="contract"):
        finish_reason_to_proto(FinishReason.ABORT)
