"""What a completion's text keeps of its special and stop tokens (vLLM's skip_special_tokens
and include_stop_str_in_output), and that the chat logprobs leave out what the text leaves
out, so their tokens join to the content."""

from __future__ import annotations

import pytest
from support.gateway_fakes import EOS_TOKEN_ID, TOKENIZER_CONFIG, TOKENIZER_JSON

from pdserve.common.generation import SamplingParams, TokenLogprobs
from pdserve.gateway.openai.logprobs import TokenTexts, chat_logprobs
from pdserve.gateway.prepare.params import PreparedRequest
from pdserve.gateway.request import GenerationRequest
from pdserve.tokenizer import Tokenizer

USER = 258  # <|user|>, special
A, B, DOT = ord("a"), ord("b"), ord(".")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_files(TOKENIZER_JSON, TOKENIZER_CONFIG)


def _prepared(tokenizer: Tokenizer, **options: object) -> PreparedRequest:
    request = GenerationRequest("r", "tiny", (A,), SamplingParams(max_tokens=8), (EOS_TOKEN_ID,))
    return PreparedRequest(request, (), tokenizer, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "completion", "expected"),
    [
        # NOTE: the default: special tokens out, the end of sequence with them.
        ({"hidden_stop_ids": frozenset({EOS_TOKEN_ID})}, [A, USER, B, EOS_TOKEN_ID], "ab"),
        # A stop token id with text of its own: out, as vLLM leaves it out...
        ({"hidden_stop_ids": frozenset({EOS_TOKEN_ID, DOT})}, [A, B, DOT], "ab"),
        # ...and in when include_stop_str_in_output emptied the set.
        ({"include_stop": True}, [A, B, DOT], "ab."),
        (
            {"skip_special_tokens": False, "hidden_stop_ids": frozenset({EOS_TOKEN_ID})},
            [A, USER, B, EOS_TOKEN_ID],
            "a<|user|>b",
        ),
        ({"skip_special_tokens": False}, [A, USER, B, EOS_TOKEN_ID], "a<|user|>b<|eos|>"),
        # A format's markup kept (every special but <|user|> skipped), stop tokens still out.
        (
            {"skipped_token_ids": frozenset({256, 257, 259}), "hidden_stop_ids": frozenset({DOT})},
            [A, USER, 257, B, DOT],
            "a<|user|>b",
        ),
    ],
)
def test_the_text_keeps_what_the_options_say(
    tokenizer: Tokenizer, options: dict[str, object], completion: list[int], expected: str
) -> None:
    prepared = _prepared(tokenizer, **options)
    text = prepared.completion_text()
    steps = [text.add([token_id]).text for token_id in completion]
    assert "".join(steps) + text.finish() == expected
    # NOTE: the chat logprobs list exactly the tokens whose text is in the content.
    scored = [TokenLogprobs(-1.0) for _ in completion]
    content = chat_logprobs(TokenTexts(), prepared, completion, scored)["content"]
    assert "".join(entry["token"] for entry in content) == expected
