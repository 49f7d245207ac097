"""The tokenizer rebuilt from SmolLM2's GGUF equals transformers' tokenizer of the same file."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.engine.model_store import ResolvedModel
from pdserve.tokenizer import Tokenizer

TEXTS = [
    "What is the capital of France?",
    "  leading spaces, trailing spaces  ",
    "Numbers 1234567 and 3.14159, and 2,048 tokens.",
    "Accents: déjà vu, naïve, Ελληνικά, 日本語のテキスト",
    "Emoji 🚀🔥 and symbols <>&%$#@!",
    "Tabs\tand\nnewlines\n\n\nhere",
    "Special tokens inside: <|im_start|>user\nhi<|im_end|> and <|endoftext|>",
    "def f(x):\n    return x ** 2  # code",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two"},
        {"role": "user", "content": "Three?"},
    ],
]


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="module")
def tokenizer(smollm2: ResolvedModel) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2.path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(
    tokenizer: Tokenizer, reference: Any, text: str
) -> None:
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text)
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi-turn"])
def test_chat_template_equals_transformers(
    tokenizer: Tokenizer, reference: Any, messages: list[dict[str, str]]
) -> None:
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.apply_chat_template(messages) == expected
    assert tokenizer.encode_chat(messages) == reference.encode(expected)


def test_special_tokens_and_eos(tokenizer: Tokenizer, reference: Any) -> None:
    assert tokenizer.eos_token_ids[0] == reference.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.vocab_size == len(reference)
