"""Token selection: logit_bias, min_tokens, penalties, a constraint's mask, greedy or
temperature with min-p, top-k and top-p, reproducible per (seed, position); and the logprobs
of what was picked."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pdserve.common.generation import SamplingParams, TokenLogprobs
from pdserve.engine.sampling_ops import (
    apply_min_p,
    apply_top_k_top_p,
    gumbel_noise,
    unpack_masks,
)

if TYPE_CHECKING:
    from pdserve.engine.constraints import ConstraintState

_MASK64 = (1 << 64) - 1

NO_TOKEN = -1
"""`Sampled.token_id` of a row where nothing may come next: its constraint, allowed_token_ids
and bad_words together leave every token out (the request cannot go on; its engine ends it
with INVALID_REQUEST, `NO_TOKEN_DETAIL`)."""

NO_TOKEN_DETAIL = (
    "no token may come next: the request's allowed_token_ids, bad_words and constraint "
    "together leave out every token"
)


def position_seed(seed: int, completion_index: int) -> int:
    """Mixes a request seed and a completion index into one 64-bit generator seed (splitmix64).

    Args:
        seed: The request's seed.
        completion_index: Index of the token within the completion (the first generated token
            is 0), counting tokens generated before any resume.
    """
    z = (seed * 0x9E3779B97F4A7C15 + completion_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & _MASK64


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one row of logits.

    Attributes:
        params: The request's settings.
        seed: The request's seed.
        completion_index: Completion index of the token this row samples.
        prompt_token_ids: The original prompt (the repetition penalty looks at it).
        output_token_ids: The completion so far, earlier attempts included (penalties).
        token_mask: The tokens the row's constraint allows next (`ConstraintState.mask`'s
            bitmask); None: any.
    """

    params: SamplingParams
    seed: int
    completion_index: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    token_mask: bytes | None = None

    @classmethod
    def of_sequence(
        cls,
        params: SamplingParams,
        seed: int,
        token_ids: Sequence[int],
        num_prompt_tokens: int,
        constraint: ConstraintState | None = None,
    ) -> SamplingRow:
        """The row of a sequence whose first `num_prompt_tokens` ids are the prompt and the
        rest its completion so far; only the histories the settings look at are kept.
        `constraint` (the request's state, when it has a constraint) is advanced over the
        completion and gives the row's mask.

        Raises:
            PdserveError: INVALID_REQUEST when the completion breaks its constraint.
        """
        needs_history = params.has_penalties or bool(params.bad_words)
        completion = token_ids[num_prompt_tokens:]
        return cls(
            params,
            seed,
            len(token_ids) - num_prompt_tokens,
            token_ids[:num_prompt_tokens] if params.repetition_penalty != 1.0 else (),
            completion if needs_history else (),
            None if constraint is None else constraint.mask(completion),
        )


@dataclass(frozen=True)
class Sampled:
    """One row's pick.

    Attributes:
        token_id: The token; `NO_TOKEN` where every token is left out.
        logprobs: Its logprob and the top alternatives, when the row's params ask for them
            (None with `NO_TOKEN`).
    """

    token_id: int
    logprobs: TokenLogprobs | None = None


class Sampler:
    """Picks one token per row of logits.

    Every step is vectorized over the batch, in this order: logit_bias; min_tokens (end ids
    masked, except in a constrained row: its constraint says when it may end); repetition,
    frequency and presence penalties; the constraint's mask (tokens it does not allow next get
    -inf); allowed_token_ids and bad_words (-inf on what they take out); then greedy argmax,
    or temperature, min-p, top-k and top-p and a Gumbel-max draw with noise from a generator
    seeded by ``position_seed(seed, completion_index)``. Every operation is row-wise, so a
    row's token depends only on its own (settings, history, seed, completion index, mask,
    logits), whatever else is in the batch. Logprobs are a log-softmax of the raw logits
    (`TokenLogprobs`).

    Args:
        eos_token_ids: The model's end-of-sequence ids (``min_tokens`` masks them).
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """The token of each row (see `sample`)."""
        return [picked.token_id for picked in self.sample(logits, rows)]

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[Sampled]:
        """Samples.

        Args:
            logits: ``[num_rows, vocab]`` float32.
            rows: One entry per row of ``logits``.

        Returns:
            One pick per row, with logprobs where the row asks for them.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} sampling rows")
        processed = self.process(logits, rows)
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        # tokens: [num_rows]
        if len(random_rows) == len(rows):
            # NOTE: no greedy row: no argmax of its own, no copy of the rows to sample.
            tokens = self._sample(rows, processed)
        else:
            tokens = processed.argmax(dim=-1)
            if random_rows:
                picked = self._sample([rows[i] for i in random_rows], processed[random_rows])
                tokens[random_rows] = picked
        token_ids = [int(t) for t in tokens.tolist()]
        logprobs = _logprobs(logits, rows, tokens)
        for i in _left_without_a_token(processed, rows):
            token_ids[i], logprobs[i] = NO_TOKEN, None
        return [Sampled(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]

    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits after logit_bias, min_tokens and penalties (the input when none apply)."""
        vocab_size = logits.shape[-1]
        device = logits.device
        # NOTE: ids past the logits (a vocabulary padded differently) cannot be picked anyway.
        biased = [
            (i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if t < vocab_size
        ]
        ended = [
            (i, t)
            for i, r in enumerate(rows)
            if r.completion_index < r.params.min_tokens and r.token_mask is None
            for t in (
                *r.params.stop_token_ids,
                *(() if r.params.ignore_eos else self.eos_token_ids),
            )
            if t < vocab_size
        ]
        penalized = [i for i, r in enumerate(rows) if r.params.has_penalties]
        constrained = [i for i, r in enumerate(rows) if r.token_mask is not None]
        filtered = [i for i, r in enumerate(rows) if r.params.has_token_filters]
        if not (biased or ended or penalized or constrained or filtered):
            return logits
        out = logits.clone()
        if biased:
            index = torch.tensor([(i, t) for i, t, _ in biased], device=device)
            values = torch.tensor([b for _, _, b in biased], dtype=out.dtype, device=device)
            out.index_put_((index[:, 0], index[:, 1]), values, accumulate=True)
        if len(penalized) == len(rows):
            _penalize(out, rows)
        elif penalized:
            out[penalized] = _penalize(out[penalized], [rows[i] for i in penalized])
        if ended:
            index = torch.tensor(ended, device=device)
            out[index[:, 0], index[:, 1]] = float("-inf")
        if constrained:
            masks = [rows[i].token_mask for i in constrained]
            allowed = unpack_masks(masks, vocab_size).to(device)  # type: ignore[arg-type]
            out[constrained] = out[constrained].masked_fill(~allowed, float("-inf"))
        if filtered:
            _filter_tokens(out, [(i, rows[i]) for i in filtered])
        return out

    def _sample(self, rows: Sequence[SamplingRow], logits: torch.Tensor) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        # scaled: [num_rows, vocab]
        scaled = logits / temperature[:, None]
        min_p = [r.params.min_p for r in rows]
        if any(p > 0 for p in min_p):
            scaled = apply_min_p(scaled, min_p)
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = apply_top_k_top_p(scaled, top_k, top_p)
        seeds = [position_seed(r.seed, r.completion_index) for r in rows]
        noise = gumbel_noise(seeds, logits.shape[-1]).to(device)
        # NOTE: `scaled` is this call's own tensor (the division made it): added to in place.
        return scaled.add_(noise).argmax(dim=-1)


def _left_without_a_token(processed: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """The rows whose every logit is -inf after processing (greedy or random, the pick would be
    token 0, which nothing allowed). Only a mask or a filter can take out every token: only
    their rows are read."""
    masked = [
        i for i, r in enumerate(rows) if r.token_mask is not None or r.params.has_token_filters
    ]
    if not masked:
        return []
    # best: [rows masked], each row's largest logit
    best = processed[masked].amax(dim=-1)
    return [masked[k] for k in torch.nonzero(best == float("-inf")).flatten().tolist()]


def _filter_tokens(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingRow]]) -> None:
    """Sets to -inf, in place, each row's tokens outside its ``allowed_token_ids`` and the
    last token of each ``bad_words`` sequence whose rest the completion so far ends with."""
    vocab_size = logits.shape[-1]
    device = logits.device
    allowing = [
        (i, _allowed_index(r.params.allowed_token_ids, vocab_size))
        for i, r in rows
        if r.params.allowed_token_ids
    ]
    if allowing:
        # mask: [rows allowing, vocab], 0 where allowed and -inf elsewhere
        mask = torch.full((len(allowing), vocab_size), float("-inf"), dtype=logits.dtype)
        positions = torch.cat([torch.full_like(index, k) for k, (_, index) in enumerate(allowing)])
        mask[positions, torch.cat([index for _, index in allowing])] = 0.0
        logits[[i for i, _ in allowing]] += mask.to(device)
    banned: list[tuple[int, int]] = []
    for i, row in rows:
        output = row.output_token_ids
        for word in row.params.bad_words:
            *rest, last = word
            if last < vocab_size and (not rest or _ends_with(output, rest)):
                banned.append((i, last))
    if banned:
        index = torch.tensor(banned, device=device)
        logits[index[:, 0], index[:, 1]] = float("-inf")


@functools.lru_cache(maxsize=1024)
def _allowed_index(token_ids: tuple[int, ...], vocab_size: int) -> torch.Tensor:
    """``allowed_token_ids`` within the vocabulary as an index (kept across steps)."""
    return torch.tensor([t for t in token_ids if t < vocab_size], dtype=torch.long)


def _ends_with(sequence: Sequence[int], tail: Sequence[int]) -> bool:
    return len(sequence) >= len(tail) and list(sequence[len(sequence) - len(tail) :]) == list(tail)


def _penalize(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Applies each row's repetition, then frequency and presence penalties, in place.

    The counts are rebuilt from each row's histories on every call, so they are the same
    wherever the request runs. Only the (row, token) pairs a history holds are touched: a
    gather and a scatter over those, never a pass over the whole vocabulary.
    """
    vocab_size = logits.shape[-1]
    device = logits.device
    flat = logits.view(-1)
    repetition = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in repetition):
        seen = _flat_index(rows, vocab_size, with_prompt=True)
        if seen:
            index = torch.tensor(seen, device=device).unique()
            penalty = torch.tensor(repetition, dtype=logits.dtype, device=device)[
                index // vocab_size
            ]
            values = flat[index]
            flat[index] = torch.where(values > 0, values / penalty, values * penalty)
    output = _flat_index(rows, vocab_size, with_prompt=False)
    if output:
        index, counts = torch.tensor(output, device=device).unique(return_counts=True)
        row = index // vocab_size
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)
        amount = frequency[row] * counts + presence[row]
        flat[index] -= amount.to(logits.dtype)
    return logits


def _flat_index(rows: Sequence[SamplingRow], vocab_size: int, *, with_prompt: bool) -> list[int]:
    """``row * vocab_size + token`` of every token in the rows' completions (and prompts)."""
    index: list[int] = []
    for i, row in enumerate(rows):
        base = i * vocab_size
        index.extend(base + t for t in row.output_token_ids if t < vocab_size)
        if with_prompt:
            index.extend(base + t for t in row.prompt_token_ids if t < vocab_size)
    return index


def _logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor
) -> list[TokenLogprobs | None]:
    """Each asking row's token logprob and top alternatives, from the raw logits."""
    asking = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not asking:
        return result
    # NOTE: logprob = logit - logsumexp(logits): no [rows, vocab] log-softmax is written out.
    # NOTE: every row asking (the usual case) reads the logits in place, with no copy.
    asked = logits if len(asking) == len(rows) else logits[asking]
    asked = asked.float()
    normalizer = torch.logsumexp(asked, dim=-1, keepdim=True)
    chosen = (asked.gather(1, tokens[asking][:, None]) - normalizer).squeeze(1).tolist()
    num_top = max(rows[i].params.logprobs or 0 for i in asking)
    top_values: list[list[float]] = [[] for _ in asking]
    top_ids: list[list[int]] = [[] for _ in asking]
    if num_top:
        top = asked.topk(num_top, dim=-1)
        top_values, top_ids = (top.values - normalizer).tolist(), top.indices.tolist()
    for j, i in enumerate(asking):
        k = rows[i].params.logprobs or 0
        result[i] = TokenLogprobs(
            chosen[j], tuple(zip(top_ids[j][:k], top_values[j][:k], strict=True))
        )
    return result
