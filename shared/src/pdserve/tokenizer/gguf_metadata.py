"""The tokenizer metadata of a GGUF file as plain values (no torch, numpy or gguf import)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer metadata of a GGUF file (llama.cpp's ``tokenizer.ggml.*`` keys).

    Attributes:
        model: ``tokenizer.ggml.model``: ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece).
        tokens: The vocabulary, index = token id.
        token_types: One llama.cpp token type per token (3 = control, 4 = user defined).
        merges: BPE merges as ``"a b"`` strings (a SentencePiece file usually has none).
        scores: One score per token (SentencePiece), from which the merges are recovered.
        architecture: ``general.architecture``; picks a SentencePiece family's text handling.
        pre: ``tokenizer.ggml.pre``, the pre-tokenizer's name.
        bos_token_id: BOS, if the file names one.
        eos_token_id: EOS, if the file names one.
        unk_token_id: UNK, if the file names one.
        pad_token_id: PAD, if the file names one.
        add_bos_token: Whether encoding prepends BOS.
        add_eos_token: Whether encoding appends EOS.
        chat_template: ``tokenizer.chat_template``, if present.
    """

    model: str
    tokens: Sequence[str]
    token_types: Sequence[int] = ()
    merges: Sequence[str] = ()
    scores: Sequence[float] = ()
    architecture: str = ""
    pre: str = "default"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.model not in SUPPORTED_TOKENIZER_MODELS:
            raise ValueError(
                f"unsupported GGUF tokenizer model {self.model!r} (tokenizer.ggml.model); "
                f"supported: {', '.join(SUPPORTED_TOKENIZER_MODELS)}"
            )
        if not self.tokens:
            raise ValueError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        if self.token_types and len(self.token_types) != len(self.tokens):
            raise ValueError("tokenizer.ggml.token_type must have one entry per token")
        for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < len(self.tokens):
                raise ValueError(f"{name} {value} is outside the vocabulary of {len(self.tokens)}")
