"""The sampler's controls: logit_bias, penalties, min_tokens, min-p and logprobs, each against a
reference (transformers' processors where one exists), vectorized over mixed batches."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from pdserve.common.generation import SamplingParams, TokenLogprobs
from pdserve.engine.sampler import NO_TOKEN, Sampler, SamplingRow
from pdserve.engine.sampling_ops import token_logprobs

VOCAB = 64
EOS = 7


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def reference_penalties(
    logits: torch.Tensor, output: list[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's definition, one token at a time."""
    out = logits.clone()
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


def test_repetition_penalty_equals_transformers_processor() -> None:
    logits = random_logits(3)
    prompt = [[1, 2, 3, 2], [10, 11], [5]]
    output = [[4, 4, 1], [], [5, 6, 60]]
    penalties = [1.3, 0.7, 1.05]
    rows = [
        SamplingRow.of_sequence(
            SamplingParams(temperature=0, repetition_penalty=p), 0, q + o, len(q)
        )
        for p, q, o in zip(penalties, prompt, output, strict=True)
    ]
    processed = Sampler().process(logits, rows)
    for i in range(3):
        processor = RepetitionPenaltyLogitsProcessor(penalties[i])
        expected = processor(torch.tensor([prompt[i] + output[i]]), logits[i : i + 1].clone())
        torch.testing.assert_close(processed[i : i + 1], expected)
    assert Sampler()(logits, rows) == processed.argmax(dim=-1).tolist()


def test_presence_frequency_and_logit_bias_equal_the_reference() -> None:
    logits = random_logits(4, seed=1)
    settings = [
        (0.5, 0.0, {}),
        (0.0, 1.2, {3: 100.0}),
        (-1.0, 0.3, {0: -5.5, 63: 2.0}),
        (0.0, 0.0, {}),  # untouched, in the same batch
    ]
    outputs = [[3, 3, 9], [1, 1, 1, 2], [63, 0, 63], [1, 2, 3]]
    rows = [
        SamplingRow(
            SamplingParams(temperature=0, presence_penalty=p, frequency_penalty=f, logit_bias=b),
            0,
            len(out),
            (),
            out,
        )
        for (p, f, b), out in zip(settings, outputs, strict=True)
    ]
    processed = Sampler().process(logits, rows)
    for i, ((presence, frequency, bias), out) in enumerate(zip(settings, outputs, strict=True)):
        expected = logits[i].clone()
        for token, value in bias.items():
            expected[token] += value
        expected = reference_penalties(expected, out, presence, frequency)
        torch.testing.assert_close(processed[i], expected)
    assert Sampler()(logits, rows)[1] == 3  # +100 wins over any penalty


def test_min_tokens_masks_end_ids_until_reached() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 50.0  # end-of-sequence is by far the most likely
    logits[:, 11] = 40.0  # a stop id, next
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(11,))
    sampler = Sampler(eos_token_ids=(EOS,))
    rows = [SamplingRow(params, 0, index) for index in (0, 1, 2)]
    first, second, third = sampler(logits, rows)
    assert first not in (EOS, 11) and second not in (EOS, 11)
    assert third == EOS
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(logits[:1], [SamplingRow(ignoring, 0, 0)]) == [EOS]  # eos is no end then


def test_min_p_drops_what_transformers_drops() -> None:
    logits = random_logits(2, seed=2) / 3  # flat enough that several tokens survive
    min_p = 0.2
    warped = MinPLogitsWarper(min_p)(torch.zeros(2, 1, dtype=torch.long), logits.clone())
    allowed = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in warped]
    params = SamplingParams(temperature=1.0, min_p=min_p)
    sampler = Sampler()
    picked: list[set[int]] = [set(), set()]
    for seed in range(300):
        tokens = sampler(logits, [SamplingRow(params, seed, 0), SamplingRow(params, seed, 1)])
        for i, token in enumerate(tokens):
            picked[i].add(token)
    for i in range(2):
        assert picked[i] <= allowed[i]
        assert len(allowed[i]) < VOCAB  # the warper did drop something
        assert len(picked[i]) > 1


def test_logprobs_are_the_raw_log_softmax_whatever_the_processing() -> None:
    logits = random_logits(3, seed=3)
    rows = [
        SamplingRow(SamplingParams(temperature=0, logprobs=5), 0, 0),
        SamplingRow(
            SamplingParams(temperature=0.7, logprobs=0, logit_bias={1: 30.0}, seed=1), 1, 0
        ),
        SamplingRow(SamplingParams(temperature=0), 0, 0),  # asks for none
    ]
    picks = Sampler().sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    first = picks[0].logprobs
    assert isinstance(first, TokenLogprobs)
    assert first.logprob == pytest.approx(float(reference[0].max()), abs=1e-5)
    expected_top = reference[0].topk(5)
    assert [t for t, _ in first.top] == expected_top.indices.tolist()
    assert [v for _, v in first.top] == pytest.approx(expected_top.values.tolist(), abs=1e-5)
    second = picks[1].logprobs
    assert picks[1].token_id == 1  # the bias picked it ...
    assert second is not None and second.top == ()
    assert second.logprob == pytest.approx(float(reference[1, 1]), abs=1e-5)  # ... not its logprob
    assert picks[2].logprobs is None


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_allowed_token_ids_are_the_only_ones_sampled(temperature: float) -> None:
    allowed = (3, 17, 40)
    params = SamplingParams(temperature=temperature, allowed_token_ids=allowed, seed=1)
    sampler = Sampler(eos_token_ids=(EOS,))
    logits = random_logits(16, seed=2)
    picked = sampler(logits, [SamplingRow(params, 50 + i, i) for i in range(16)])
    assert set(picked) <= set(allowed)
    if temperature == 0:
        assert picked == [allowed[int(logits[i, list(allowed)].argmax())] for i in range(16)]
    else:
        assert len(set(picked)) > 1  # drawn among them, not always the likeliest
    # NOTE: the logprobs stay the model's: a log-softmax over the whole vocabulary.
    scored = sampler.sample(logits[:1], [SamplingRow(SamplingParams(
        temperature=0, allowed_token_ids=allowed, logprobs=1), 0, 0)])[0]  # fmt: skip
    assert scored.logprobs is not None
    expected = torch.log_softmax(logits[0], dim=-1)[scored.token_id]
    assert scored.logprobs.logprob == pytest.approx(float(expected), abs=1e-5)


def test_a_bad_word_is_banned_where_the_completion_would_finish_it() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 20] = 10.0  # the bad word's last token is the likeliest
    logits[0, 21] = 5.0
    params = SamplingParams(temperature=0, bad_words=((12, 20), (30,)))
    sampler = Sampler(eos_token_ids=(EOS,))

    def pick(completion: list[int]) -> int:
        prompt = [1, 2]
        row = SamplingRow.of_sequence(params, 0, [*prompt, *completion], len(prompt))
        return sampler(logits, [row])[0]

    assert pick([5, 12]) == 21  # 12 then 20 would complete (12, 20)
    assert pick([12, 5]) == 20  # 20 alone is no bad word
    assert pick([]) == 20  # the prompt does not count: only the completion
    logits[0, 30] = 50.0
    assert pick([4]) == 20  # a one-token bad word is never sampled


def mask_allowing(*token_ids: int) -> bytes:
    """A constraint's bitmask (llguidance's layout) allowing `token_ids`."""
    words = [0] * ((VOCAB + 31) // 32)
    for t in token_ids:
        words[t // 32] |= 1 << (t % 32)
    return b"".join(w.to_bytes(4, "little") for w in words)


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_a_row_whose_filters_leave_no_token_gets_none(temperature: float) -> None:
    sampler = Sampler(eos_token_ids=(EOS,))
    logits = random_logits(4, seed=6)
    params = SamplingParams(temperature=temperature, logprobs=2, seed=3)
    nine_or_eleven = mask_allowing(9, 11)
    rows = [
        # NOTE: the only allowed id is a one-token bad word.
        SamplingRow(replace(params, allowed_token_ids=(7,), bad_words=((7,),)), 1, 0),
        # NOTE: the constraint allows 9 and 11, allowed_token_ids neither.
        SamplingRow(replace(params, allowed_token_ids=(5, 6)), 2, 0, token_mask=nine_or_eleven),
        SamplingRow(replace(params, allowed_token_ids=(5, 9)), 3, 0, token_mask=nine_or_eleven),
        SamplingRow(params, 4, 0),
    ]  # fmt: skip
    picked = sampler.sample(logits, rows)
    assert [p.token_id for p in picked[:3]] == [NO_TOKEN, NO_TOKEN, 9]
    assert picked[0].logprobs is None and picked[1].logprobs is None
    assert picked[2].logprobs is not None and picked[3].logprobs is not None
    # NOTE: the other rows pick what they pick alone.
    assert picked[3] == sampler.sample(logits[3:], rows[3:])[0]
    assert sampler(logits[:1], rows[:1]) == [NO_TOKEN]


def test_a_row_is_independent_of_its_batch() -> None:
    logits = random_logits(7, seed=4)
    params = [
        SamplingParams(temperature=0.9, presence_penalty=1.0, seed=5),
        SamplingParams(temperature=0, logit_bias={2: 3.0}),
        SamplingParams(temperature=1.1, min_p=0.05, top_k=20, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, repetition_penalty=1.4, logprobs=3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0, min_tokens=3),
        SamplingParams(temperature=0.7, allowed_token_ids=(1, 2, 30), bad_words=((4, 30),)),
    ]
    histories = [[1, 2, 3, 3], [5], [9, 9, 9, 8], [10, 11, 12, 10], [], [4, 4], [6, 4]]
    rows = [
        SamplingRow.of_sequence(p, 100 + i, h, 1 if h else 0)
        for i, (p, h) in enumerate(zip(params, histories, strict=True))
    ]
    sampler = Sampler(eos_token_ids=(EOS,))
    together = sampler.sample(logits, rows)
    alone = [sampler.sample(logits[i : i + 1], [rows[i]])[0] for i in range(7)]
    assert [p.token_id for p in together] == [p.token_id for p in alone]
    lp_together, lp_alone = together[3].logprobs, alone[3].logprobs
    assert lp_together is not None and lp_alone is not None
    assert lp_together.logprob == pytest.approx(lp_alone.logprob, abs=1e-6)


def test_prompt_logprobs_score_each_next_token() -> None:
    logits = random_logits(4, seed=5)
    targets = [3, 0, 63, 7]
    scored = token_logprobs(logits, targets, num_top=2)
    reference = torch.log_softmax(logits, dim=-1)
    for i, target in enumerate(targets):
        assert scored[i].logprob == pytest.approx(float(reference[i, target]), abs=1e-5)
        assert [t for t, _ in scored[i].top] == reference[i].topk(2).indices.tolist()
    assert token_logprobs(logits, targets, num_top=0)[0].top == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("logprobs", 21),
        ("min_tokens", -1),
        ("logit_bias", {3: 101.0}),
        ("allowed_token_ids", (-1,)),
        ("bad_words", ((),)),
    ],
)
def test_out_of_range_controls_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]
