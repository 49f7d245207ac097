"""Tiny SentencePiece vocabularies as llama.cpp stores them in a GGUF (``tokenizer.ggml.model =
llama``), for Llama 2 / Mistral style files and for Gemma's.

llama.cpp's ``_set_vocab_sentencepiece`` writes every piece of the ``.model`` file in id order with
its score and type: ``<unk>`` (unknown), the control tokens, the 256 byte-fallback tokens
``<0x00>``..``<0xFF>`` (byte), then the pieces, ``▁`` standing for a space, best score first. There
are no merges; a reader recovers them from the scores (Gemma: from the order).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGUFWriter, TokenType

# Words whose pieces the vocabulary holds (every prefix of each is a piece, so BPE reaches the
# whole word): leading "▁", accents, CJK, digits. Anything else falls back to single characters
# or, failing those, to bytes.
SENTENCEPIECE_WORDS = (
    "▁the", "▁hello", "▁world", "ing", "▁café", "▁naïve", "▁日本", "語", "12", "▁12",
    "▁user", "▁model", "er", "▁a", "▁is",
)  # fmt: skip
# Single characters: a-z, some accents and CJK; digits 0-9.
SENTENCEPIECE_CHARS = "▁abcdefghijklmnopqrstuvwxyzéïàç日本語のテキスト0123456789.,!?'"
LLAMA_CONTROL = ("<s>", "</s>")
GEMMA_CONTROL = ("<pad>", "<eos>", "<bos>")
GEMMA_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


class SentencePieceVocab(NamedTuple):
    """A SentencePiece vocabulary as llama.cpp stores it, with the special token ids."""

    tokens: list[str]
    scores: list[float]
    token_types: list[int]
    bos_token_id: int
    eos_token_id: int
    unk_token_id: int
    pad_token_id: int | None
    chat_template: str


def _pieces() -> list[str]:
    pieces: list[str] = list(dict.fromkeys(SENTENCEPIECE_CHARS))
    for word in SENTENCEPIECE_WORDS:
        for end in range(2, len(word) + 1):
            if word[:end] not in pieces:
                pieces.append(word[:end])
    return pieces


def llama_sentencepiece_vocab() -> SentencePieceVocab:
    """Llama 2 / Mistral: ``<unk> <s> </s>``, 256 byte tokens, then the pieces by score."""
    tokens = ["<unk>", *LLAMA_CONTROL]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = _pieces()
    scores = [0.0] * len(tokens) + [-float(rank) for rank in range(len(pieces))]
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    return SentencePieceVocab(
        tokens, scores, [int(t) for t in types], 1, 2, 0, None, LLAMA_CHAT_TEMPLATE
    )


def gemma_sentencepiece_vocab() -> SentencePieceVocab:
    """Gemma: ``<pad> <eos> <bos> <unk>``, turn tokens, whitespace runs, bytes, then the pieces.

    Gemma's file spells a token of only spaces with real spaces (``"  "``) and lists newline and
    tab runs as user-defined tokens; its scores do not follow the merge order, the ids do.
    """
    tokens = [*GEMMA_CONTROL, "<unk>", "<mask>", *GEMMA_TURN_TOKENS]
    types = [TokenType.CONTROL] * 3 + [TokenType.UNKNOWN, TokenType.USER_DEFINED]
    types += [TokenType.USER_DEFINED] * len(GEMMA_TURN_TOKENS)
    whitespace = ["\n", "\n\n", "\t", "\t\t", "  ", "   "]
    tokens += whitespace
    types += [TokenType.USER_DEFINED] * len(whitespace)
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = _pieces()
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    # NOTE: Gemma's scores are not in merge order; these are shuffled on purpose so that a
    # reader which sorts by score would merge differently.
    scores = [0.0] * (len(tokens) - len(pieces)) + [
        -float((rank * 7) % len(pieces)) for rank in range(len(pieces))
    ]
    return SentencePieceVocab(
        tokens, scores, [int(t) for t in types], 2, 1, 3, 0, GEMMA_CHAT_TEMPLATE
    )


def add_sentencepiece_vocab(
    writer: GGUFWriter, vocab: SentencePieceVocab, *, add_bos_token: bool = True
) -> None:
    """Writes `vocab` as llama.cpp's ``_set_vocab_sentencepiece`` does."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.token_types)
    writer.add_bos_token_id(vocab.bos_token_id)
    writer.add_eos_token_id(vocab.eos_token_id)
    writer.add_unk_token_id(vocab.unk_token_id)
    if vocab.pad_token_id is not None:
        writer.add_pad_token_id(vocab.pad_token_id)
    writer.add_add_bos_token(add_bos_token)
    writer.add_add_eos_token(False)
    writer.add_chat_template(vocab.chat_template)


def write_vocab_gguf(
    path: Path, architecture: str, vocab: SentencePieceVocab, *, add_bos_token: bool = True
) -> Path:
    """A GGUF of `architecture` that holds `vocab` and just enough model metadata to be read."""
    writer = GGUFWriter(path, architecture)
    writer.add_name(f"tiny-{architecture}-vocab")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_key_length(4)
    writer.add_layer_norm_rms_eps(1e-6)
    add_sentencepiece_vocab(writer, vocab, add_bos_token=add_bos_token)
    writer.add_tensor("token_embd.weight", np.zeros((len(vocab.tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
