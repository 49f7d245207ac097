"""Constraints: checked without a tokenizer, compiled against the default model's tokenizer,
applied by the sampler, and replayed exactly on a continuation."""

from __future__ import annotations

import json
import re

import pytest
import torch

from pdserve.common.constraints import MAX_GBNF_RULES, check
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import Constraint, ConstraintKind, SamplingParams
from pdserve.engine.constraints import ConstraintCompiler, ConstraintState
from pdserve.engine.model_store import ResolvedModel
from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.engine.sampling_ops import unpack_masks
from pdserve.tokenizer.tokenizer import Tokenizer

K = ConstraintKind
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "digit": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["answer", "digit", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(smollm2: ResolvedModel) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2.path)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> ConstraintCompiler:
    compiler = ConstraintCompiler(tokenizer.tokenizer_json, tokenizer.eos_token_ids)
    yield compiler
    compiler.close()


@pytest.mark.parametrize(
    ("constraint", "problem"),
    [
        (Constraint(K.REGEX, "(unclosed"), "unclosed group"),
        (Constraint(K.JSON_SCHEMA, "{not json"), "key must be a string"),
        (Constraint(K.JSON_SCHEMA, '{"$ref": "#/missing"}'), "does not exist"),
        (Constraint(K.GRAMMAR, "start: undefined_rule"), "unknown name"),
        (Constraint(K.GRAMMAR, 'root ::= "a" | undefined'), "GBNF: Rule 'undefined' not found"),
        (Constraint(K.GRAMMAR, 'item ::= "a"'), "GBNF: No 'root' rule found"),
        (Constraint(K.GRAMMAR, "root ::= [0-9"), "GBNF: Unexpected end of input"),
        (Constraint(K.GRAMMAR, "root ::= " + "(" * 5000 + '"a"' + ")" * 5000), "GBNF:"),
        (
            Constraint(K.GRAMMAR, "root ::= r0\n" + "".join(f'r{i} ::= "a"\n' for i in range(256))),
            f"at most {MAX_GBNF_RULES} are converted",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_is_an_invalid_request(
    constraint: Constraint, problem: str
) -> None:
    with pytest.raises(PdserveError) as raised:
        check(constraint)
    assert raised.value.reason is ErrorReason.INVALID_REQUEST
    assert constraint.kind.value in raised.value.message and problem in raised.value.message


def test_random_logits_under_a_schema_give_valid_json(
    compiler: ConstraintCompiler, tokenizer: Tokenizer
) -> None:
    """Whatever the model prefers, the completion parses and fits the schema."""
    constraint = Constraint(K.JSON_SCHEMA, json.dumps(SCHEMA))
    params = SamplingParams(temperature=1.0, max_tokens=200, constraint=constraint)
    sampler = Sampler(tokenizer.eos_token_ids)
    vocab_size = tokenizer.vocab_size
    for seed in range(4):
        state = compiler.start(constraint)
        generator = torch.Generator().manual_seed(seed)
        completion: list[int] = []
        while len(completion) < 200:
            row = SamplingRow.of_sequence(params, seed, completion, 0, state)
            logits = torch.randn(1, vocab_size, generator=generator) * 5
            token = sampler(logits, [row])[0]
            if token in tokenizer.eos_token_ids:
                break
            completion.append(token)
        value = json.loads(tokenizer.decode(completion))
        assert set(value) == {"answer", "digit", "tags"}
        assert value["answer"] in {"yes", "no", "maybe"} and 0 <= value["digit"] <= 9
        assert len(value["tags"]) <= 3 and set(value["tags"]) <= {"a", "b"}
        assert state.is_complete


def test_a_continuation_replays_the_completion_into_the_same_masks(
    compiler: ConstraintCompiler, tokenizer: Tokenizer
) -> None:
    """A matcher fed the whole completion at once (a reschedule) masks as the one that saw
    it token by token."""
    constraint = Constraint(K.JSON_SCHEMA, json.dumps(SCHEMA))
    completion = tokenizer.encode('{"answer": "maybe", "digit": 7, "tags": ["a"', False)
    stepwise = compiler.start(constraint)
    masks = [stepwise.mask(completion[:i]) for i in range(len(completion) + 1)]
    for cut in range(len(completion) + 1):
        replayed = compiler.start(constraint)
        assert replayed.mask(completion[:cut]) == masks[cut]


def test_a_completion_the_constraint_never_allowed_is_refused(
    compiler: ConstraintCompiler, tokenizer: Tokenizer
) -> None:
    state = compiler.start(Constraint(K.CHOICE, choices=("yes", "no")))
    with pytest.raises(PdserveError) as raised:
        state.mask(tokenizer.encode("maybe", False))
    assert raised.value.reason is ErrorReason.INVALID_REQUEST


@pytest.mark.parametrize(
    ("constraint", "accepted"),
    [
        (Constraint(K.CHOICE, choices=('say "hi"', "é ok")), re.compile(r'say "hi"|é ok')),
        (Constraint(K.REGEX, "[0-9]{3}-[a-z]{2}"), re.compile(r"[0-9]{3}-[a-z]{2}")),
        (Constraint(K.GRAMMAR, 'start: "(" NUM ")"\nNUM: /[1-9]/'), re.compile(r"\([1-9]\)")),
        # NOTE: GBNF, llama.cpp's syntax (and xgrammar's), converted by llguidance.
        (
            Constraint(K.GRAMMAR, 'root ::= ("yes" | "no") " " num\nnum ::= [1-9] [0-9]?'),
            re.compile(r"(yes|no) [1-9][0-9]?"),
        ),
    ],
)
def test_every_kind_constrains_the_text(
    compiler: ConstraintCompiler,
    tokenizer: Tokenizer,
    constraint: Constraint,
    accepted: re.Pattern[str],
) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=50, constraint=constraint)
    sampler = Sampler(tokenizer.eos_token_ids)
    for seed in range(3):
        state, completion = compiler.start(constraint), []
        generator = torch.Generator().manual_seed(seed)
        while len(completion) < 50:
            row = SamplingRow.of_sequence(params, seed, completion, 0, state)
            token = sampler(torch.randn(1, tokenizer.vocab_size, generator=generator), [row])[0]
            if token in tokenizer.eos_token_ids:
                break
            completion.append(token)
        assert accepted.fullmatch(tokenizer.decode(completion))


def test_compiled_grammars_are_cached_by_content(compiler: ConstraintCompiler) -> None:
    constraint = Constraint(K.REGEX, "cached-[0-9]+")
    compiled, hits = compiler.num_compiled, compiler.num_cache_hits
    first = compiler.prepare(constraint).result(timeout=30)
    second = compiler.prepare(Constraint(K.REGEX, "cached-[0-9]+")).result(timeout=30)
    assert (compiler.num_compiled, compiler.num_cache_hits) == (compiled + 1, hits + 1)
    assert isinstance(first, ConstraintState) and first is not second


def test_a_prepared_constraint_that_does_not_compile_fails_its_future(
    compiler: ConstraintCompiler,
) -> None:
    future = compiler.prepare(Constraint(K.REGEX, "(("))
    with pytest.raises(PdserveError):
        future.result(timeout=30)


def test_a_mask_unpacks_bit_i_of_word_i_over_32() -> None:
    words = torch.tensor([0b101, -(1 << 31), 0], dtype=torch.int32)  # bit 31 of word 1
    allowed = unpack_masks([words.numpy().tobytes()], 70)
    assert torch.nonzero(allowed[0]).flatten().tolist() == [0, 2, 63]
    assert allowed.shape == (1, 70)  # ids past the mask (64..69) are not allowed


def test_min_tokens_leaves_the_end_to_the_constraint(
    compiler: ConstraintCompiler, tokenizer: Tokenizer
) -> None:
    """A complete constrained completion may only end, even before min_tokens."""
    constraint = Constraint(K.CHOICE, choices=("yes",))
    params = SamplingParams(min_tokens=10, max_tokens=20, constraint=constraint)
    state = compiler.start(constraint)
    done = tokenizer.encode("yes", False)
    row = SamplingRow.of_sequence(params, 0, done, 0, state)
    token = Sampler(tokenizer.eos_token_ids)(torch.zeros(1, tokenizer.vocab_size), [row])[0]
    assert token in tokenizer.eos_token_ids
