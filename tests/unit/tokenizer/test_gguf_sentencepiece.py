"""SentencePiece GGUF vocabularies (``tokenizer.ggml.model = llama``) rebuilt like transformers.

Each test writes a tiny SentencePiece vocabulary the way llama.cpp stores one (scores, byte
fallback tokens, control tokens, no merges), rebuilds ``tokenizer.json`` from its metadata as
`convert_gguf` does, and holds pdserve's tokenizer equal to transformers' tokenizer of the same
file: ids, decoded text, the chat prompt and the special tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader
from support.gguf_vocabs import (
    SentencePieceVocab,
    gemma_sentencepiece_vocab,
    llama_sentencepiece_vocab,
    write_vocab_gguf,
)
from transformers import AutoTokenizer

from pdserve.engine.gguf_import import gguf_vocab, read_metadata
from pdserve.tokenizer import Tokenizer
from pdserve.tokenizer.gguf_vocab import tokenizer_files

TEXT = (
    "The café is naïve, déjà vu.\n\nΕλληνικά 日本語のテキスト 🚀👨\u200d👩\u200d👧 "
    "1234567 and 3.14\t\ttabs   three spaces\n  two leading\r\nend "
)
TEXTS = (
    TEXT,
    "hello world",
    " the leading space",
    "  two leading spaces",
    "",
    " ",
    "\n",
    "<s>[INST] hi [/INST]</s>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<unk><pad><bos><eos><mask>",
)
MESSAGES = [
    {"role": "user", "content": "Sé breve 👋 hello world 12"},
    {"role": "assistant", "content": "the café"},
    {"role": "user", "content": "日本語?"},
]
# (architecture, vocabulary): Llama 2 / Mistral / Mixtral, Phi-3 and Gemma 3 text handling.
CASES = [
    ("llama", llama_sentencepiece_vocab()),
    ("phi3", llama_sentencepiece_vocab()),
    ("gemma3", gemma_sentencepiece_vocab()),
]


def load_both(
    tmp_path: Path, architecture: str, vocab: SentencePieceVocab
) -> tuple[Tokenizer, Any]:
    gguf_path = write_vocab_gguf(tmp_path / "vocab.gguf", architecture, vocab)
    tokenizer_json, tokenizer_config = tokenizer_files(
        gguf_vocab(read_metadata(GGUFReader(gguf_path)))
    )
    model_dir = tmp_path / "converted"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (model_dir / "tokenizer_config.json").write_text(tokenizer_config, encoding="utf-8")
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_path.name)
    return Tokenizer.from_pretrained(model_dir), reference


@pytest.mark.parametrize(("architecture", "vocab"), CASES, ids=[c[0] for c in CASES])
def test_encode_and_decode_equal_transformers(
    tmp_path: Path, architecture: str, vocab: SentencePieceVocab
) -> None:
    """Merges from scores (Gemma: ids), byte fallback, ▁ for spaces, BOS, special tokens."""
    ours, theirs = load_both(tmp_path, architecture, vocab)

    assert ours.vocab_size == len(theirs)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.bos_token_id == vocab.bos_token_id
    assert ours.eos_token_ids == (vocab.eos_token_id,)


@pytest.mark.parametrize(("architecture", "vocab"), CASES, ids=[c[0] for c in CASES])
def test_multilingual_text_round_trips(
    tmp_path: Path, architecture: str, vocab: SentencePieceVocab
) -> None:
    """Pieces out of the vocabulary (emoji, Greek) come back through the byte tokens."""
    ours, _ = load_both(tmp_path, architecture, vocab)
    ids = ours.encode(TEXT, add_special_tokens=False)
    byte_ids = {vocab.tokens.index(f"<0x{byte:02X}>") for byte in "🚀".encode()}

    assert byte_ids <= set(ids)
    assert ours.decode(ids) == TEXT


@pytest.mark.parametrize(("architecture", "vocab"), CASES, ids=[c[0] for c in CASES])
def test_chat_prompt_equals_transformers(
    tmp_path: Path, architecture: str, vocab: SentencePieceVocab
) -> None:
    ours, theirs = load_both(tmp_path, architecture, vocab)

    assert ours.apply_chat_template(MESSAGES) == theirs.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    assert ours.encode_chat(MESSAGES) == theirs.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_dict=False
    )
