"""The SentencePiece BPE tokenizer of a GGUF whose ``tokenizer.ggml.model`` is ``llama``.

llama.cpp writes a SentencePiece vocabulary (Llama 2, Mistral, Gemma, Phi-3) as its pieces in id
order with a score and a type each: ``▁`` stands for a space, ``<0x00>``..``<0xFF>`` are the
byte-fallback tokens, and there are no merges. This rebuilds the BPE the way transformers does for
the same file: the merges recovered from the scores (Gemma: from the order), byte fallback, and
the text handling of the family, picked by ``general.architecture`` as transformers picks it:

* Llama 2 / Mistral (any other architecture): a ``Metaspace`` pre-tokenizer that prepends ``▁``
  to the text and a decoder that strips it again.
* Phi-3: the same pieces, but the ``▁`` comes from a normalizer, which also turns a leading space
  into a second ``▁``.
* Gemma: no prepended ``▁``; spaces become ``▁`` and a token of only spaces, which the file spells
  with real spaces, is looked up as that many ``▁``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

if TYPE_CHECKING:
    from pdserve.tokenizer.gguf_metadata import GgufVocab

SPACE = "\u2581"
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
GEMMA_MASK_TOKEN = "<mask>"
PHI3_ARCHITECTURES = ("phi3",)


def sentencepiece_tokens(vocab: GgufVocab) -> list[str]:
    """The pieces as the tokenizer looks them up (Gemma's space-only tokens as ``▁`` runs)."""
    if vocab.architecture not in GEMMA_ARCHITECTURES:
        return list(vocab.tokens)
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in vocab.tokens]


def recovered_merges(
    token_ids: Mapping[str, int], ranks: Mapping[str, float]
) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first.

    Every split of a piece into two pieces of the vocabulary is a merge; merges are ordered by the
    rank of the piece they make (higher first), then by the lengths of their halves, as
    transformers' ``generate_merges`` orders them.

    Args:
        token_ids: Piece -> id.
        ranks: Piece -> rank (the score, or for Gemma the negated id).
    """
    candidates: list[tuple[str, str, float]] = []
    for piece, rank in ranks.items():
        local = [
            (piece[:cut], piece[cut:], rank)
            for cut in range(1, len(piece))
            if piece[:cut] in token_ids and piece[cut:] in token_ids
        ]
        local.sort(key=lambda merge: (token_ids[merge[0]], token_ids[merge[1]]))
        candidates.extend(local)
    # NOTE: one descending sort over (rank, left length, right length), as transformers sorts;
    # Python's sort is stable, so equal keys keep the order above.
    candidates.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def merge_pair(merge: str) -> tuple[str, str]:
    """A ``tokenizer.ggml.merges`` entry (``"a b"``) as a pair."""
    left, separator, right = merge.partition(" ")
    if not separator or not left or not right:
        raise ValueError(f"malformed BPE merge {merge!r} in tokenizer.ggml.merges")
    return left, right


def build_sentencepiece_backend(vocab: GgufVocab) -> tokenizers.Tokenizer:
    """The BPE with byte fallback and the family's normalizer, pre-tokenizer and decoder.

    Added tokens and the post-processor are left to the caller.
    """
    tokens = sentencepiece_tokens(vocab)
    token_ids = {token: index for index, token in enumerate(tokens)}
    if vocab.merges:
        merges = [merge_pair(merge) for merge in vocab.merges]
    elif vocab.architecture in GEMMA_ARCHITECTURES:
        # NOTE: Gemma's scores do not follow its merge order; the ids do (as in transformers).
        merges = recovered_merges(token_ids, {token: -index for token, index in token_ids.items()})
    else:
        if len(vocab.scores) != len(tokens):
            raise ValueError(
                "a SentencePiece GGUF vocabulary needs one score per token (tokenizer.ggml.scores)"
            )
        merges = recovered_merges(token_ids, dict(zip(tokens, vocab.scores, strict=True)))
    is_gemma = vocab.architecture in GEMMA_ARCHITECTURES
    unk_token = None
    if is_gemma and vocab.unk_token_id is not None:
        unk_token = tokens[vocab.unk_token_id]
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=token_ids,
            merges=merges,
            dropout=None,
            unk_token=unk_token,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    fallback: list[decoders.Decoder] = [
        decoders.Replace(SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if is_gemma:
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(fallback)
        return backend
    if vocab.architecture in PHI3_ARCHITECTURES:
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first", split=False
        )
    backend.decoder = decoders.Sequence([*fallback, decoders.Strip(" ", 1, 0)])
    return backend
