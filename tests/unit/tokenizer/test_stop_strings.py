from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.tokenizer import StopStringMatcher, TextStream, Tokenizer


def _reference(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Character by character: cut at the first stop string to be completed."""
    for end in range(1, len(text) + 1):
        ending = [stop for stop in stops if text[:end].endswith(stop)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


def _chunks(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _run(matcher: StopStringMatcher, chunks: list[str]) -> tuple[str, bool]:
    released = []
    for chunk in chunks:
        match = matcher.push(chunk)
        released.append(match.text)
        if match.is_stopped:
            return "".join(released), True
    return "".join(released) + matcher.flush(), False


SMALL_TEXT = st.text(alphabet="abc👋", max_size=30)


@settings(max_examples=300, deadline=None)
@given(
    text=SMALL_TEXT,
    stops=st.lists(st.text(alphabet="abc👋", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_any_chunking_gives_the_reference_result(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    matcher = StopStringMatcher(stops)
    released, is_stopped = _run(matcher, _chunks(text, cuts))
    expected_text, expected_stop = _reference(text, stops)
    assert released == expected_text
    assert is_stopped == (expected_stop is not None)
    assert matcher.stop == expected_stop


def test_stop_split_across_chunks() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.push("42 </ans") == ("42 ", False, None)
    assert matcher.held_text == "</ans"
    assert matcher.push("wer> tail") == ("", True, "</answer>")
    assert matcher.push("more") == ("", True, "</answer>")
    assert matcher.flush() == ""


def test_near_miss_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("a ST") == ("a ", False, None)
    assert matcher.push("x") == ("STx", False, None)
    assert matcher.push("ST") == ("", False, None)
    assert matcher.flush() == "ST"


def test_first_completed_stop_wins() -> None:
    # "bc" is complete at the third character, before "abcd" could be.
    assert StopStringMatcher(["abcd", "bc"]).push("abcd") == ("a", True, "bc")
    # Two stops ending on the same character: the longer one cuts more.
    assert StopStringMatcher(["c", "bc"]).push("abcd") == ("a", True, "bc")


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        StopStringMatcher(["ok", ""])


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Hello, world! STOP and more", ["STOP"], "Hello, world! "),
        ("wave 👋 bye", ["👋"], "wave "),
        ("naïve café", ["é"], "naïve caf"),
        ("no stop here", ["xyz"], "no stop here"),
    ],
)
def test_text_stream_cuts_stops_split_across_tokens(
    any_tokenizer: Tokenizer, text: str, stops: list[str], expected: str
) -> None:
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(any_tokenizer, stops)
    deltas = []
    for token_id in ids:
        delta = stream.add_tokens([token_id])
        deltas.append(delta.text)
        if delta.is_stopped:
            break
    final = stream.finish()
    deltas.append(final.text)
    assert "".join(deltas) == stream.text == expected
    assert stream.is_stopped == (expected != text)
    assert all("\ufffd" not in delta for delta in deltas)


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet="ab é👋", max_size=25),
    stop=st.text(alphabet="ab é👋", min_size=1, max_size=3),
)
def test_text_stream_matches_reference(demo_tokenizer: Tokenizer, text: str, stop: str) -> None:
    stream = TextStream(demo_tokenizer, [stop])
    for token_id in demo_tokenizer.encode(text, add_special_tokens=False):
        if stream.add_tokens([token_id]).is_stopped:
            break
    final = stream.finish()
    expected_text, expected_stop = _reference(text, [stop])
    assert stream.text == expected_text
    assert final.is_stopped == (expected_stop is not None)


def test_text_stream_after_stop(demo_tokenizer: Tokenizer) -> None:
    stream = TextStream(demo_tokenizer, ["b"])
    assert stream.add_tokens([ord("a"), ord("b"), ord("c")]) == ("a", True, "b")
    assert stream.add_tokens([ord("d")]) == ("", True, "b")
    assert stream.finish() == ("", True, "b")
    with pytest.raises(RuntimeError):
        stream.add_tokens([ord("e")])


@settings(max_examples=100, deadline=None)
@given(
    text=st.text(alphabet="ab é👋", max_size=25),
    stop=st.text(alphabet="ab é👋", min_size=1, max_size=3),
)
def test_text_stream_with_include_stop_ends_with_the_stop(
    demo_tokenizer: Tokenizer, text: str, stop: str
) -> None:
    stream = TextStream(demo_tokenizer, [stop], include_stop=True)
    deltas = []
    for token_id in demo_tokenizer.encode(text, add_special_tokens=False):
        delta = stream.add_tokens([token_id])
        deltas.append(delta.text)
        if delta.is_stopped:
            break
    deltas.append(stream.finish().text)
    expected_text, expected_stop = _reference(text, [stop])
    assert "".join(deltas) == stream.text == expected_text + (expected_stop or "")
