"""The vocabulary of a generation request, spoken by the gateway, the prefill, the decode and the
engine alike: what a request asks for (`SamplingParams`, the seed rule), how it ends
(`FinishReason`, `check_stop`), and how many KV blocks its tokens take (`num_blocks_for`).

Plain Python only (no torch, no protobuf), so every service can import it; the one mapping to
and from pdserve.v1 messages is `pdserve.serving.convert`.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Container
from dataclasses import dataclass

MAX_SEED = 2**63  # the sampler's generator takes 63 bits
DEFAULT_SEED = 0
MAX_TOP_LOGPROBS = 20  # most alternatives a token's logprobs may carry


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability and the most likely tokens at its position.

    Log-probabilities come from the model's distribution: a log-softmax of the raw logits,
    before logit_bias, penalties, temperature or truncation, the same on prefill and decode.

    Attributes:
        logprob: The token's log-probability.
        top: (token id, log-probability) of the most likely tokens, most likely first.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class ConstraintKind(enum.Enum):
    """What a `Constraint`'s value is."""

    JSON_SCHEMA = "json_schema"  # a JSON Schema's text
    JSON_OBJECT = "json_object"  # any JSON object (no value)
    REGEX = "regex"  # a regular expression the whole completion matches
    CHOICE = "choice"  # one of `Constraint.choices`
    GRAMMAR = "grammar"  # a grammar in llguidance's Lark-like syntax (or GBNF)


@dataclass(frozen=True)
class Constraint:
    """A constraint on a completion's text (structured outputs).

    Every sampled token must keep the completion a prefix of a string the constraint accepts;
    once it is complete, only an end-of-sequence id may follow. Compiling and applying it is
    `pdserve.engine.constraints`' work (checking it without a tokenizer:
    `pdserve.common.constraints`).

    Attributes:
        kind: What `value` is.
        value: The schema's JSON text, the regex or the grammar ("" for JSON_OBJECT, CHOICE).
        choices: The allowed strings (CHOICE only).
    """

    kind: ConstraintKind
    value: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind is ConstraintKind.CHOICE:
            if not self.choices:
                raise ValueError("a choice constraint needs at least one choice")
        elif self.choices:
            raise ValueError(f"a {self.kind.value} constraint takes no choices")
        if self.kind in (ConstraintKind.JSON_OBJECT, ConstraintKind.CHOICE):
            if self.value:
                raise ValueError(f"a {self.kind.value} constraint takes no value")
        elif not self.value:
            raise ValueError(f"a {self.kind.value} constraint needs a value")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    Attributes:
        temperature: 0 means greedy; otherwise logits are divided by it before sampling.
        top_k: Keep the k most likely tokens; 0 disables.
        top_p: Keep the smallest set of tokens whose probability reaches top_p; 1.0 disables.
        seed: Makes sampling reproducible: the token at completion index i is a pure function of
            (seed, i, logits). None: `resolve_seed` picks one.
        max_tokens: Most tokens to generate (counting tokens generated before a resume).
        stop_token_ids: Token ids that end the request (the id is included in the output).
        ignore_eos: Keep generating past the model's end-of-sequence ids.
        presence_penalty: Subtracted once from the logit of each token in the completion so far.
        frequency_penalty: Subtracted from a token's logit once per time it is in the completion.
        repetition_penalty: Divides the positive logits (multiplies the negative ones) of every
            token in the prompt or the completion so far; 1.0 disables.
        logit_bias: (token id, bias) pairs added to the logits before anything else.
        min_tokens: End-of-sequence and stop ids cannot be sampled before this many tokens.
        min_p: Drop tokens below min_p times the most likely token's probability; 0 disables.
        logprobs: Return each generated token's logprob and this many alternatives; None: no
            logprobs.
        prompt_logprobs: Return each prompt token's logprob (after the first) and this many
            alternatives; None: none.
        constraint: What the completion's text must match (structured outputs); None: free.
        allowed_token_ids: When not empty, the only ids that can be sampled.
        bad_words: Token sequences the completion must not produce: a sequence's last token
            cannot be sampled where the completion so far ends with the rest of it.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
        # NOTE: accept lists and dicts from callers but keep the frozen value hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, dict) else bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        for token_id, value in self.logit_bias:
            if token_id < 0 or not -100.0 <= value <= 100.0:
                raise ValueError(
                    f"logit_bias needs ids >= 0 and values in [-100, 100], got {token_id}: {value}"
                )
        object.__setattr__(
            self, "allowed_token_ids", tuple(sorted({int(t) for t in self.allowed_token_ids}))
        )
        object.__setattr__(
            self, "bad_words", tuple(tuple(int(t) for t in word) for word in self.bad_words)
        )
        if any(t < 0 for t in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must be non-negative")
        if any(not word or min(word) < 0 for word in self.bad_words):
            raise ValueError("bad_words must be sequences of one or more token ids >= 0")
        if self.constraint is not None and self.ignore_eos:
            # NOTE: a complete constrained completion can only end: it would loop otherwise.
            raise ValueError("ignore_eos cannot be combined with a constraint")

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def has_token_filters(self) -> bool:
        """True when allowed_token_ids or bad_words take tokens out of the choice."""
        return bool(self.allowed_token_ids or self.bad_words)

    @property
    def is_greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature == 0.0 or self.top_k == 1


def resolve_seed(seed: int | None, rng: random.Random | None = None) -> int:
    """The seed a request samples with: its own, else one drawn from `rng`, else `DEFAULT_SEED`.

    Where a request enters (the gateway, the colocated engine) a seedless request gets a seed
    drawn from `rng`, so that every later attempt continues the same random stream. An instance
    that receives no seed (the gateway always sends one) uses `DEFAULT_SEED`, so that the
    prefill's first token and the decode's continuation come from one stream.
    """
    if seed is not None:
        return seed
    if rng is not None:
        return rng.getrandbits(63)
    return DEFAULT_SEED


class FinishReason(enum.Enum):
    """Why a request ended, in OpenAI's vocabulary.

    STOP and LENGTH travel between the services; TOOL_CALLS only from the gateway to its clients
    (a completion of a request with tools that ended with tool calls); ABORT is the colocated
    engine's own ending of a request it was told to abort (a service reports that as an error
    status instead).
    """

    STOP = "stop"  # an end-of-sequence id or a stop token id
    LENGTH = "length"  # max_tokens or the model's maximum length
    TOOL_CALLS = "tool_calls"  # the completion ended with tool calls (the gateway's reading)
    ABORT = "abort"


def is_stop_token(token_id: int, sampling: SamplingParams, eos_token_ids: Container[int]) -> bool:
    """Whether generating `token_id` ends the completion: a stop id, or an end-of-sequence id
    unless ``sampling.ignore_eos``."""
    if token_id in sampling.stop_token_ids:
        return True
    return not sampling.ignore_eos and token_id in eos_token_ids


def is_length_reached(
    num_output_tokens: int,
    sampling: SamplingParams,
    num_tokens: int = 0,
    max_model_len: int | None = None,
) -> bool:
    """Whether a completion of `num_output_tokens` tokens (a sequence of `num_tokens`) may grow
    no further: ``max_tokens`` is reached, or the model's length (unless `max_model_len` is
    None)."""
    if num_output_tokens >= sampling.max_tokens:
        return True
    return max_model_len is not None and num_tokens >= max_model_len


def check_stop(
    token_id: int,
    num_output_tokens: int,
    sampling: SamplingParams,
    eos_token_ids: Container[int] = (),
    *,
    num_tokens: int = 0,
    max_model_len: int | None = None,
) -> FinishReason | None:
    """The stop rule: whether the completion ends after its latest token, and why.

    The order matters and is the same everywhere: a stop or end-of-sequence token first, then
    ``max_tokens`` (counted over the whole completion, across attempts), then the model length.

    Args:
        token_id: The sequence's last token: the one just generated (it stays in the output).
        num_output_tokens: Completion tokens so far, `token_id` included; 0 means `token_id`
            is still the prompt's, so it cannot stop the request.
        sampling: The request's ``max_tokens``, ``stop_token_ids`` and ``ignore_eos``.
        eos_token_ids: The model's end-of-sequence ids.
        num_tokens: Prompt plus completion tokens, `token_id` included.
        max_model_len: The model's longest sequence; None leaves the length unchecked (the
            gateway: its backends check it).

    Returns:
        STOP or LENGTH when the completion is over, None while it goes on.
    """
    if num_output_tokens > 0 and is_stop_token(token_id, sampling, eos_token_ids):
        return FinishReason.STOP
    if is_length_reached(num_output_tokens, sampling, num_tokens, max_model_len):
        return FinishReason.LENGTH
    return None


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers."""
    return -(-a // b)


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold `num_tokens` tokens (the last block may be partly filled)."""
    return cdiv(num_tokens, block_size)
