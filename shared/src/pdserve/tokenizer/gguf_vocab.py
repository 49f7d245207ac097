"""A Hugging Face ``tokenizer.json`` rebuilt from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``: llama.cpp stores the vocabulary, the merges, the token
types and the special token ids as metadata (``tokenizer.ggml.*``). This module turns those into
the files a Hugging Face model directory has, built the way transformers builds the tokenizer of
the same GGUF, so that the gateway tokenizes exactly as transformers does. It takes plain
values (no `gguf`, numpy or torch import), so it stays usable from the torch-free gateway.

Supported: ``tokenizer.ggml.model = gpt2`` (byte-level BPE, used by SmolLM2, Llama 3, Qwen2/3,
Phi-4 and most BPE models), with the pre-tokenizer split that ``tokenizer.ggml.pre`` names, and
``tokenizer.ggml.model = llama`` (SentencePiece BPE with scores and byte fallback: Llama 2,
Mistral, Mixtral, Gemma, Phi-3; see `pdserve.tokenizer.gguf_sentencepiece`).
"""

from __future__ import annotations

import json
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from pdserve.tokenizer.gguf_metadata import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_USER_DEFINED,
    GgufVocab,
)
from pdserve.tokenizer.gguf_sentencepiece import (
    GEMMA_ARCHITECTURES,
    GEMMA_MASK_TOKEN,
    build_sentencepiece_backend,
    merge_pair,
    sentencepiece_tokens,
)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# NOTE: llama.cpp's pre-tokenizer names whose split differs from GPT-2's, the same table as
# transformers' (e.g. Mistral Nemo is a "llama" GGUF with "tekken"). Any other name (e.g.
# SmolLM2's "smollm", "default") splits like GPT-2, as in transformers.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "falcon-h1": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "midm-2.0": _LLAMA3_SPLIT,
    "lfm2": _LLAMA3_SPLIT,
    "jina-v5-nano": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "kormo": _QWEN2_SPLIT,
    "f2llmv2": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
    "kanana2": _GPT4O_SPLIT,
    "talkie": _GPT4O_SPLIT,
    "minimax-m2": _GPT4O_SPLIT,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which byte-level vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    offset = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + offset)
            offset += 1
    return mapping


def build_tokenizer(vocab: GgufVocab) -> tokenizers.Tokenizer:
    """The tokenizer that `vocab` describes, as transformers builds it for the same file."""
    if vocab.model == "llama":
        return _build_sentencepiece(vocab)
    return _build_byte_level(vocab)


def _build_sentencepiece(vocab: GgufVocab) -> tokenizers.Tokenizer:
    backend = build_sentencepiece_backend(vocab)
    tokens = sentencepiece_tokens(vocab)
    types = vocab.token_types or [0] * len(tokens)
    # NOTE: transformers makes the named special tokens (e.g. <unk>, typed "unknown") special
    # as well as the control ones, so decoding with skip_special_tokens drops the same ids.
    named = {vocab.bos_token_id, vocab.eos_token_id, vocab.unk_token_id, vocab.pad_token_id}
    if vocab.architecture in GEMMA_ARCHITECTURES and GEMMA_MASK_TOKEN in tokens:
        # NOTE: Gemma's tokenizer names a mask token too (as its published tokenizer.json does).
        named.add(tokens.index(GEMMA_MASK_TOKEN))
    special_ids = {
        index for index, kind in enumerate(types) if kind == TOKEN_TYPE_CONTROL or index in named
    }
    special = [
        AddedToken(tokens[index], normalized=False, special=True) for index in sorted(special_ids)
    ]
    backend.add_special_tokens(special)
    # NOTE: a user-defined token counts under its own spelling only (Gemma's "\n\n");
    # a space-only one was respelled as "▁" runs and reaches the same id through the merges.
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for index, (token, original, kind) in enumerate(
            zip(tokens, vocab.tokens, types, strict=True)
        )
        if kind == TOKEN_TYPE_USER_DEFINED and token == original and index not in special_ids
    ]
    backend.add_tokens(user_defined)
    backend.post_processor = _post_processor(vocab)
    return backend


def _build_byte_level(vocab: GgufVocab) -> tokenizers.Tokenizer:
    alphabet = byte_alphabet()
    letters = set(alphabet.values())

    def spelled(token: str) -> str:
        if set(token) <= letters:
            return token
        return "".join(alphabet[byte] for byte in token.encode("utf-8"))

    token_ids = {spelled(token): index for index, token in enumerate(vocab.tokens)}
    merges = [merge_pair(merge) for merge in vocab.merges]
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=token_ids,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(vocab.pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    types = vocab.token_types or [0] * len(vocab.tokens)
    # NOTE: a control token spelled outside the byte alphabet is a llama.cpp mislabel; adding it
    # would grow the vocabulary past the model's (transformers skips it too).
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(vocab.tokens, types, strict=True)
        if kind == TOKEN_TYPE_CONTROL and set(token) <= letters
    ]
    backend.add_special_tokens(control)
    # NOTE: llama.cpp stores a user-defined token as its text (e.g. "\t\t"). One that is not
    # itself a vocabulary key would be added under a new id past the model's vocabulary, so it
    # stays out and its text encodes through the merges (transformers skips it too).
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(vocab.tokens, types, strict=True)
        if kind == TOKEN_TYPE_USER_DEFINED and token in token_ids
    ]
    backend.add_tokens(user_defined)
    backend.post_processor = _post_processor(vocab)
    return backend


def _post_processor(vocab: GgufVocab) -> processors.TemplateProcessing:
    single, pair, special = ["$A:0"], ["$A:0", "$B:1"], []
    for is_added, token_id, at_start in (
        (vocab.add_bos_token, vocab.bos_token_id, True),
        (vocab.add_eos_token, vocab.eos_token_id, False),
    ):
        if not is_added or token_id is None:
            continue
        token = vocab.tokens[token_id]
        special.append((token, token_id))
        if at_start:
            single, pair = [f"{token}:0", *single], [f"{token}:0", *pair[:1], f"{token}:1", pair[1]]
        else:
            single, pair = [*single, f"{token}:0"], [pair[0], f"{token}:0", pair[1], f"{token}:1"]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def tokenizer_config(vocab: GgufVocab) -> dict[str, Any]:
    """The ``tokenizer_config.json`` object: special tokens, BOS/EOS flags, chat template."""
    config: dict[str, Any] = {
        "add_bos_token": vocab.add_bos_token,
        "add_eos_token": vocab.add_eos_token,
    }
    for key, token_id in (
        ("bos_token", vocab.bos_token_id),
        ("eos_token", vocab.eos_token_id),
        ("unk_token", vocab.unk_token_id),
        ("pad_token", vocab.pad_token_id),
    ):
        if token_id is not None:
            config[key] = vocab.tokens[token_id]
    if vocab.chat_template:
        config["chat_template"] = vocab.chat_template
    return config


def tokenizer_files(vocab: GgufVocab) -> tuple[str, str]:
    """(``tokenizer.json`` text, ``tokenizer_config.json`` text) for a model directory."""
    tokenizer_json = build_tokenizer(vocab).to_str(pretty=False)
    return tokenizer_json, json.dumps(tokenizer_config(vocab), indent=2, ensure_ascii=False)
