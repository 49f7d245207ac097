from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast

from pdserve.engine import demo_tokenizer as demo
from pdserve.tokenizer import Tokenizer, TokenizerConfig

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n",
    "héllo wörld, ça va? naïve café",
    "日本語のテキスト",
    "emoji 👋🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "mixed: a€b¢c𝄞d",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(any_tokenizer: Tokenizer, text: str) -> None:
    ids = any_tokenizer.encode(text, add_special_tokens=False)
    assert any_tokenizer.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_demo_round_trip_of_any_text(demo_tokenizer: Tokenizer, text: str) -> None:
    assume(not any(token in text for token in demo.SPECIAL_TOKENS))
    ids = demo_tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert demo_tokenizer.decode(ids) == text


def test_demo_special_tokens(demo_tokenizer: Tokenizer) -> None:
    assert demo_tokenizer.encode("hi") == [demo.BOS_TOKEN_ID, ord("h"), ord("i")]
    assert demo_tokenizer.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]
    assert demo_tokenizer.bos_token_id == demo.BOS_TOKEN_ID
    assert demo_tokenizer.eos_token_ids == (demo.EOS_TOKEN_ID, demo.END_TOKEN_ID)
    assert demo_tokenizer.vocab_size == demo.VOCAB_SIZE
    user = demo_tokenizer.token_to_id("<|user|>")
    assert user == demo.special_token_id("<|user|>")
    assert demo_tokenizer.encode("<|user|>x", add_special_tokens=False) == [user, ord("x")]
    assert demo_tokenizer.decode([user, ord("x")]) == "x"
    assert demo_tokenizer.decode([user, ord("x")], skip_special_tokens=False) == "<|user|>x"


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8")) | st.sampled_from(TEXTS))
def test_encode_matches_transformers(demo_tokenizer_dir: Path, text: str) -> None:
    ours = Tokenizer.from_pretrained(demo_tokenizer_dir)
    theirs = _hf_tokenizer(demo_tokenizer_dir)
    assert ours.encode(text) == theirs(text)["input_ids"]
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


_HF_CACHE: dict[Path, PreTrainedTokenizerFast] = {}


def _hf_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    if directory not in _HF_CACHE:
        _HF_CACHE[directory] = PreTrainedTokenizerFast(
            tokenizer_file=str(directory / "tokenizer.json")
        )
    return _HF_CACHE[directory]


def test_from_pretrained_reads_every_file(demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((demo_tokenizer_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [263, 257]}))
    tokenizer = Tokenizer.from_pretrained(tmp_path)
    # The standalone template wins over the config's, as in transformers.
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"
    assert tokenizer.eos_token_ids == (257, 263)
    assert tokenizer.tokenizer_json == (tmp_path / "tokenizer.json").read_text()


def test_from_pretrained_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_from_files_rebuilds_an_identical_tokenizer(demo_tokenizer: Tokenizer) -> None:
    # What the gateway does with a prefill's GetModelInfo answer.
    copy = Tokenizer.from_files(
        demo_tokenizer.tokenizer_json,
        json.loads(json.dumps(demo.tokenizer_config())),
        demo_tokenizer.chat_template,
        eos_token_ids=demo_tokenizer.eos_token_ids,
    )
    messages = [{"role": "user", "content": "ça va? 👋"}]
    assert copy.encode_chat(messages) == demo_tokenizer.encode_chat(messages)
    assert copy.eos_token_ids == demo_tokenizer.eos_token_ids


def test_unknown_eos_token_is_rejected(demo_tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_files(demo_tokenizer.tokenizer_json, {"eos_token": "</nope>"})


def test_invalid_tokenizer_json_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_files("{not json")


def test_add_bos_token_applies_without_post_processor(demo_tokenizer: Tokenizer) -> None:
    data = json.loads(demo_tokenizer.tokenizer_json)
    data["post_processor"] = None
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>"}
    plain = Tokenizer.from_files(json.dumps(data), config)
    assert plain.encode("a") == [ord("a")]
    with_bos = Tokenizer.from_files(json.dumps(data), {**config, "add_bos_token": True})
    assert with_bos.encode("a") == [plain.bos_token_id, ord("a")]
    assert with_bos.encode("a", add_special_tokens=False) == [ord("a")]
    # With a post-processor, tokenizer.json decides (it adds BOS itself).
    assert Tokenizer.from_files(
        demo_tokenizer.tokenizer_json, {**config, "add_bos_token": False}
    ).encode("a") == [plain.bos_token_id, ord("a")]


def test_config_parsing() -> None:
    config = TokenizerConfig.from_dict(
        {
            "bos_token": {"content": "<s>", "lstrip": False, "__type": "AddedToken"},
            "eos_token": "</s>",
            "pad_token": None,
            "add_bos_token": True,
            "chat_template": [
                {"name": "tool_use", "template": "T"},
                {"name": "default", "template": "D"},
            ],
        }
    )
    assert config.bos_token == "<s>"
    assert config.eos_token == "</s>"
    assert "pad_token" not in config.special_tokens
    assert config.add_bos_token is True
    assert config.chat_template == "D"
    with pytest.raises(ValueError, match="add_eos_token"):
        TokenizerConfig.from_dict({"add_eos_token": "yes"})


def test_package_does_not_import_torch() -> None:
    code = (
        "import sys, pdserve.tokenizer\n"
        "assert 'torch' not in sys.modules, 'pdserve.tokenizer imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
