from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pdserve.engine import demo_tokenizer as demo
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer

REPLACEMENT = "\ufffd"

# NOTE: a SentencePiece-style vocabulary spells a space "▁" (U+2581), so a literal "▁" in the
# text comes back as a space: no such tokenizer round-trips it, and none is asked to here.
METASPACE = "\u2581"
# Text without U+FFFD itself, so any U+FFFD in a delta would be half a character.
TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters=REPLACEMENT + METASPACE))


def _stream(
    tokenizer: Tokenizer, token_ids: list[int], chunk_sizes: list[int] | None = None
) -> tuple[list[str], str]:
    """Feeds `token_ids` in chunks; returns the deltas and the final flush."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    sizes = iter(chunk_sizes or [])
    deltas = []
    position = 0
    while position < len(token_ids):
        size = max(1, next(sizes, 1))
        deltas.append(detokenizer.add_tokens(token_ids[position : position + size]))
        position += size
    return deltas, detokenizer.flush()


def test_emoji_split_over_four_tokens_is_emitted_whole(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode("a👋b", add_special_tokens=False)
    assert len(ids) == 6  # one token per byte
    deltas, rest = _stream(demo_tokenizer, ids)
    assert deltas == ["a", "", "", "", "👋", "b"]
    assert rest == ""


@settings(max_examples=150, deadline=None)
@given(text=TEXT, data=st.data())
def test_deltas_are_whole_characters_and_concatenate_to_decode(
    any_tokenizer: Tokenizer, text: str, data: st.DataObject
) -> None:
    # NOTE: a special token's spelling ("<|bos|>") encodes to that token, which decode skips.
    assume(not any(token in text for token in any_tokenizer.config.special_tokens.values()))
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    chunk_sizes = data.draw(st.lists(st.integers(1, 5), max_size=len(ids)))
    deltas, rest = _stream(any_tokenizer, ids, chunk_sizes)
    assert all(REPLACEMENT not in delta for delta in deltas)
    assert "".join(deltas) + rest == any_tokenizer.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, demo.VOCAB_SIZE - 1), max_size=40))
def test_any_token_sequence_concatenates_to_decode(
    demo_tokenizer: Tokenizer, ids: list[int]
) -> None:
    # What a random model produces: invalid UTF-8 and special tokens anywhere.
    deltas, rest = _stream(demo_tokenizer, ids)
    full_text = demo_tokenizer.decode(ids)
    assert "".join(deltas) + rest == full_text
    # Text once sent is never taken back: every partial concatenation is a prefix.
    for end in range(len(deltas)):
        assert full_text.startswith("".join(deltas[: end + 1]))


def test_incomplete_character_is_held_then_flushed(demo_tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(demo_tokenizer)
    euro = "€".encode()
    assert detokenizer.add_tokens([ord("x"), euro[0], euro[1]]) == ""
    assert detokenizer.num_held_tokens == 3
    assert detokenizer.flush() == "x" + REPLACEMENT
    assert detokenizer.text == demo_tokenizer.decode([ord("x"), euro[0], euro[1]])
    with pytest.raises(RuntimeError):
        detokenizer.add_tokens([ord("y")])


def test_invalid_byte_followed_by_text(demo_tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(demo_tokenizer)
    assert detokenizer.add_tokens([0xE2]) == ""
    assert detokenizer.add_tokens([ord("a")]) == REPLACEMENT + "a"
    assert detokenizer.token_ids == [0xE2, ord("a")]


def test_special_tokens(demo_tokenizer: Tokenizer) -> None:
    end = demo.END_TOKEN_ID
    skipping = IncrementalDetokenizer(demo_tokenizer)
    assert [skipping.add_tokens([t]) for t in (ord("a"), end, ord("b"))] == ["a", "", "b"]
    keeping = IncrementalDetokenizer(demo_tokenizer, skip_special_tokens=False)
    assert [keeping.add_tokens([t]) for t in (ord("a"), end, ord("b"))] == ["a", "<|end|>", "b"]


def test_context_keeps_the_space_of_the_first_word(byte_fallback_bpe: Tokenizer) -> None:
    prompt = byte_fallback_bpe.encode("the", add_special_tokens=False)
    completion = byte_fallback_bpe.encode("the world", add_special_tokens=False)
    assert byte_fallback_bpe.id_to_token(completion[0]) == "▁the"
    # SentencePiece drops the leading space of the first token of a decode.
    without_context = IncrementalDetokenizer(byte_fallback_bpe)
    assert without_context.add_tokens(completion) == "the world"
    with_context = IncrementalDetokenizer(byte_fallback_bpe, context_token_ids=prompt)
    assert with_context.add_tokens(completion) == " the world"
    assert with_context.token_ids == completion
