"""transformers as the reference in tests: what the engine's output must equal."""

from __future__ import annotations

from typing import Any

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


def chat_greedy(
    reference: tuple[Any, Any], messages: list[dict[str, Any]], max_tokens: int
) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids up to and including ``<|im_end|>``) of a chat, from a
    transformers (tokenizer, model) pair such as the ``smollm2_reference`` fixture."""
    tokenizer, model = reference
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    prompt_ids = list(encoded["input_ids"])
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False
        )
    generated = output[0, len(prompt_ids) :].tolist()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if end in generated:
        generated = generated[: generated.index(end) + 1]
    return prompt_ids, generated
