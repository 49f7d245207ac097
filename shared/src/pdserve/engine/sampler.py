"""Token selection: greedy, temperature, top-k, top-p, reproducible per (seed, position)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.common.generation import SamplingParams

_MASK64 = (1 << 64) - 1


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
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    seed: int
    completion_index: int


class Sampler:
    """Picks one token per row of logits.

    Random rows use the Gumbel-max trick with noise from a generator seeded by
    ``position_seed(seed, completion_index)``; every operation is row-wise, so a row's token
    depends only on its own (seed, completion index, logits), whatever else is in the batch.
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """Samples.

        Args:
            logits: ``[num_rows, vocab]`` float32.
            rows: One entry per row of ``logits``.

        Returns:
            One token id per row.
        """
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} sampling rows")
        # tokens: [num_rows]
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if random_rows:
            picked = self._sample([rows[i] for i in random_rows], logits[random_rows])
            tokens[random_rows] = picked
        return [int(t) for t in tokens.tolist()]

    def _sample(self, rows: Sequence[SamplingRow], logits: torch.Tensor) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        # scaled: [num_rows, vocab]
        scaled = logits / temperature[:, None]
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = _apply_top_k_top_p(scaled, top_k, top_p)
        noise = torch.stack([_gumbel_noise(r, logits.shape[-1]) for r in rows]).to(device)
        return (scaled + noise).argmax(dim=-1)


def _gumbel_noise(row: SamplingRow, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator()
    generator.manual_seed(position_seed(row.seed, row.completion_index))
    uniform = torch.rand(vocab_size, generator=generator).clamp_(min=1e-20)
    return -torch.log(-torch.log(uniform))


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Sets logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    vocab_size = scaled.shape[-1]
    # sorted_logits: [num_rows, vocab], descending
    sorted_logits = scaled.sort(dim=-1, descending=True).values
    k = torch.tensor(
        [kk if 0 < kk < vocab_size else vocab_size for kk in top_k], device=scaled.device
    )
    ranks = torch.arange(vocab_size, device=scaled.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # NOTE: a token is dropped when the tokens ranked above it already reach top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    # NOTE: top_p == 1 must keep everything even where the float cumsum reaches 1 early.
    p = torch.tensor([pp if pp < 1.0 else 2.0 for pp in top_p], device=scaled.device)[:, None]
    keep = (mass_before < p) & (ranks < k[:, None])
    keep[:, 0] = True
    num_kept = keep.sum(dim=-1, keepdim=True)
    cutoff = sorted_logits.gather(1, num_kept - 1)
    return scaled.masked_fill(scaled < cutoff, float("-inf"))
