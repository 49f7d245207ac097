"""Tokenizers for the tokenizer tests, all built in memory (no download, no torch).

* the demo model's tokenizer: one token per byte, so multi-byte characters always span
  several tokens;
* a byte-level BPE trained here, whose merges join the bytes of some multi-byte characters
  but not of others;
* a SentencePiece-style BPE with byte fallback: known pieces are words, anything else is
  spelled as ``<0xNN>`` byte tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from pdserve.engine import demo_tokenizer as demo
from pdserve.tokenizer import Tokenizer

TRAINING_TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, ça va? naïve café",
    "日本語のテキストです。日本語",
    "emoji 👋🏽 and 🎉 party",
] * 20


def _trained_byte_level_bpe() -> str:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
    )
    backend.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    return str(backend.to_str())


def _byte_fallback_bpe() -> str:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    pieces += ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁t", "he", "▁the", "▁w", "or", "▁wor", "ld"]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "w"), ("o", "r"), ("▁w", "or")]
    merges.append(("l", "d"))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return str(backend.to_str())


@pytest.fixture(scope="session")
def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_files(
        demo.build_demo_tokenizer().to_str(),
        demo.tokenizer_config(),
        eos_token_ids=[demo.END_TOKEN_ID],
    )


@pytest.fixture(scope="session")
def demo_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the demo tokenizer's files, as in the demo model."""
    directory = tmp_path_factory.mktemp("demo-tokenizer")
    (directory / "tokenizer.json").write_text(demo.build_demo_tokenizer().to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps(demo.tokenizer_config()))
    return directory


@pytest.fixture(scope="session")
def byte_level_bpe() -> Tokenizer:
    return Tokenizer.from_files(
        _trained_byte_level_bpe(), {"bos_token": "<s>", "eos_token": "</s>"}
    )


@pytest.fixture(scope="session")
def byte_fallback_bpe() -> Tokenizer:
    return Tokenizer.from_files(
        _byte_fallback_bpe(), {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    )


@pytest.fixture(scope="session", params=["demo", "byte_level_bpe", "byte_fallback_bpe"])
def any_tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    """Each of the three tokenizer kinds in turn."""
    fixture = "demo_tokenizer" if request.param == "demo" else request.param
    tokenizer: Tokenizer = request.getfixturevalue(fixture)
    return tokenizer
