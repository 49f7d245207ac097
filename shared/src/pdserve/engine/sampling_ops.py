"""The sampler's tensor operations that need no request: constraint bitmasks, min-p and
top-k/top-p truncation, Gumbel noise, and the logprobs of given tokens."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pdserve.common.generation import TokenLogprobs


def unpack_masks(masks: Sequence[bytes], vocab_size: int) -> torch.Tensor:
    """``[len(masks), vocab_size]`` bool of llguidance bitmasks (bit i % 32 of 32-bit word
    i // 32 set: token i allowed); ids past a mask are not allowed."""
    # words: [rows, num_words] int32
    words = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.int32).view(len(masks), -1)
    shifts = torch.arange(32, dtype=torch.int32)
    # bits: [rows, num_words * 32]
    bits = ((words.unsqueeze(-1) >> shifts) & 1).view(len(masks), -1).bool()
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    padding = torch.zeros(len(masks), vocab_size - bits.shape[1], dtype=torch.bool)
    return torch.cat([bits, padding], dim=1)


def gumbel_noise(seeds: Sequence[int], vocab_size: int) -> torch.Tensor:
    """``[len(seeds), vocab_size]`` Gumbel noise, row i from a generator seeded with
    ``seeds[i]`` (on the CPU, so every machine draws the same). Each row is drawn and
    transformed on its own, in place in the result: the values do not depend on the other
    rows."""
    noise = torch.empty(len(seeds), vocab_size)
    generator = torch.Generator()
    for row, seed in zip(noise, seeds, strict=True):
        generator.manual_seed(seed)
        torch.rand(vocab_size, generator=generator, out=row)
        # NOTE: -log(-log(u)), each step in place.
        row.clamp_(min=1e-20).log_().neg_().log_().neg_()
    return noise


def apply_min_p(scaled: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Sets each row's logits whose probability is below min_p times its top one's to -inf,
    in place (`scaled` is the sampler's own tensor).

    In logits: p_i < min_p * p_max exactly when logit_i < logit_max + log(min_p), so no
    softmax is needed.
    """
    floor = torch.tensor(
        [math.log(p) if p > 0 else float("-inf") for p in min_p],
        dtype=scaled.dtype,
        device=scaled.device,
    )[:, None]
    return scaled.masked_fill_(scaled < scaled.amax(dim=-1, keepdim=True) + floor, float("-inf"))


def apply_top_k_top_p(scaled: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
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


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int
) -> list[TokenLogprobs]:
    """Logprobs of `token_ids` under ``logits[i]`` each (row i predicts token_ids[i]), with
    `num_top` alternatives: the prompt logprobs of a prefill.

    Args:
        logits: ``[num_positions, vocab]``.
        token_ids: One token per row of `logits`.
        num_top: Alternatives per position (0 to 20).
    """
    if not token_ids:
        return []
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(token_ids), device=logits.device)[:, None]
    chosen = log_probs.gather(1, index).squeeze(1).tolist()
    if not num_top:
        return [TokenLogprobs(value) for value in chosen]
    top = log_probs.topk(num_top, dim=-1)
    return [
        TokenLogprobs(value, tuple(zip(ids, values, strict=True)))
        for value, ids, values in zip(
            chosen, top.indices.tolist(), top.values.tolist(), strict=True
        )
    ]
