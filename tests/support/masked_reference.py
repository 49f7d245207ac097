"""The reference for constrained output: transformers' greedy tokens, masked by the engine's
compiled constraint (what the services must produce token for token)."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.common.generation import Constraint, SamplingParams
from pdserve.engine.constraints import ConstraintCompiler
from pdserve.engine.sampler import Sampler, SamplingRow


def masked_greedy(
    reference: tuple[Any, Any], prompt: list[int], constraint: Constraint, max_tokens: int
) -> list[int]:
    """Greedy tokens of transformers' model (`reference`: tokenizer, model) after `prompt`,
    masked by `constraint`; the end id is kept when it comes."""
    hf_tokenizer, model = reference
    eos = [hf_tokenizer.eos_token_id]
    compiler = ConstraintCompiler(hf_tokenizer.backend_tokenizer.to_str(), eos)
    state = compiler.start(constraint)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint)
    sampler = Sampler(eos)
    completion: list[int] = []
    # NOTE: transformers' own KV cache, as its `generate` uses it: the prompt once, then one
    # token per step (recomputing a 700-token tool prompt at every step took ~20 s).
    past: Any = None
    step = prompt
    with torch.no_grad():
        while len(completion) < max_tokens:
            out = model(torch.tensor([step]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1:].float()
            token = sampler(logits, [SamplingRow.of_sequence(params, 0, completion, 0, state)])[0]
            completion.append(token)
            if token in eos:
                break
            step = [token]
    compiler.close()
    return completion
