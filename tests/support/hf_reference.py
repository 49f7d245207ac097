"""transformers as the reference in tests: what the engine's output must equal."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model


def hf_greedy(model: torch.nn.Module, prompt: list[int], num_new: int) -> list[int]:
    """Exactly `num_new` greedy tokens (EOS ignored) of `prompt` from a transformers model."""
    return _greedy(model, prompt, num_new).sequences[0, len(prompt) :].tolist()


def hf_greedy_with_margin(
    model: torch.nn.Module, prompt: list[int], num_new: int
) -> tuple[list[int], float]:
    """`hf_greedy(model, prompt, num_new)`, and the smallest gap between the best and the
    second-best logit over its steps: how far the reference's greedy choice is from a tie.

    Another engine's float32 sums differ from transformers' in the last bits; where the gap is
    far above that, a greedy comparison with transformers cannot flip on summation order.
    """
    output = _greedy(model, prompt, num_new)
    steps = torch.cat([logits.float() for logits in output.logits])
    top2 = steps.topk(2, dim=-1).values
    return output.sequences[0, len(prompt) :].tolist(), float((top2[:, 0] - top2[:, 1]).min())


def _greedy(model: torch.nn.Module, prompt: list[int], num_new: int) -> Any:
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )


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


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """While transformers reads a GGUF: gguf-py's parse of a file (`GGUFReader`) made once, not
    once each for the tokenizer, the config and the weights, and its tensor-name map made once
    per architecture, not once per tensor. The same gguf-py code reads the same values: 14.9 s
    -> 7.3 s for SmolLM2's file (equal tensors, vocabulary and config), most of the rest the
    fields' 49,152 token strings read one by one."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[Any, ...], Any] = {}

    def reader(path: Any, *args: Any) -> Any:
        key = (os.fspath(path), *args)
        if key not in readers:
            readers[key] = reader_class(path, *args)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def gguf_reference(gguf: Path, cache_root: Path | None = None) -> tuple[Any, Any]:
    """(tokenizer, float32 model) as transformers reads `gguf`, in eval mode.

    With `cache_root`, what transformers read is saved there once (``save_pretrained``, under
    a key of the file's name, size and modification time) and loaded from there afterwards:
    the same tensors and tokenizer, without dequantizing the GGUF again. Concurrent callers
    (pytest workers) take a lock, so one reads the GGUF and the others load its copy.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def read_gguf() -> tuple[Any, Any]:
        directory, name = str(gguf.parent), gguf.name
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=name, dtype=torch.float32
            )
        return tokenizer, model.eval()

    if cache_root is None:
        return read_gguf()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    saved = cache_root / key[:16]
    with open(cache_root / "lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (saved / "complete").is_file():
            tokenizer, model = read_gguf()
            partial = cache_root / f"{key[:16]}.partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            tokenizer.save_pretrained(partial)
            # NOTE: transformers refuses save_pretrained on a model read from a GGUF (its
            # config says "quantized with gguf"); the tensors it made are float32, so they go
            # out as they are, with the config less that mark.
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (partial / "config.json").write_text(json.dumps(config))
            save_model(model, str(partial / "model.safetensors"))
            (partial / "complete").write_text(gguf.name + "\n")
            shutil.rmtree(saved, ignore_errors=True)
            partial.rename(saved)
            return tokenizer, model
    tokenizer = AutoTokenizer.from_pretrained(saved)
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    return tokenizer, model.eval()
