"""transformers as the reference in tests: what the engine's output must equal."""

from __future__ import annotations

import torch


def hf_greedy(model: torch.nn.Module, prompt: list[int], num_new: int) -> list[int]:
    """Exactly `num_new` greedy tokens (EOS ignored) of `prompt` from a transformers model."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
