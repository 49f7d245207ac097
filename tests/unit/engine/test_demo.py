from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.common import env
from pdserve.engine import demo
from pdserve.engine import demo_tokenizer as demo_tok
from pdserve.tokenizer import Tokenizer

# The demo weights are part of the contract between machines: prefill and decode instances
# generate them independently and must agree bit for bit. Changing them needs a new name.
PINNED_WEIGHTS_SHA256 = "4d29153c5ae0d26c7ee0dab80e6355e87221419fc62d75ece094650360931b32"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo.ensure_demo_model(tmp_path_factory.mktemp("cache"))


def test_layout_and_manifest(model_dir: Path) -> None:
    assert model_dir.name == "demo-llama-v1"
    names = {path.name for path in model_dir.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "manifest.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert manifest["weights_sha256"] == PINNED_WEIGHTS_SHA256
    assert set(manifest["files"]) == names - {"manifest.json"}
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]


def test_generation_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    other = demo.ensure_demo_model(tmp_path)
    assert other != model_dir
    for path in model_dir.iterdir():
        assert (other / path.name).read_bytes() == path.read_bytes(), path.name
    assert demo.weights_sha256(demo.build_weights()) == PINNED_WEIGHTS_SHA256


def test_a_different_seed_gives_different_weights() -> None:
    spec = demo.DemoModelSpec(seed=demo.DEMO_SPEC.seed + 1)
    assert demo.weights_sha256(demo.build_weights(spec)) != PINNED_WEIGHTS_SHA256


def test_existing_model_is_reused(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(directory: Path, spec: demo.DemoModelSpec = demo.DEMO_SPEC) -> str:
        raise AssertionError("regenerated an existing model")

    monkeypatch.setattr(demo, "write_demo_model", fail)
    assert demo.ensure_demo_model(model_dir.parent) == model_dir


def test_losing_a_race_keeps_the_winners_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = demo.write_demo_model

    def write_while_another_process_finishes(
        directory: Path, spec: demo.DemoModelSpec = demo.DEMO_SPEC
    ) -> str:
        digest = write(directory, spec)
        winner = tmp_path / demo.DEMO_MODEL_NAME
        winner.mkdir()
        write(winner, spec)
        return digest

    monkeypatch.setattr(demo, "write_demo_model", write_while_another_process_finishes)
    target = demo.ensure_demo_model(tmp_path)
    assert target == tmp_path / demo.DEMO_MODEL_NAME
    assert [p.name for p in tmp_path.iterdir()] == [demo.DEMO_MODEL_NAME]


def test_incomplete_directory_is_reported(tmp_path: Path) -> None:
    (tmp_path / demo.DEMO_MODEL_NAME).mkdir()
    with pytest.raises(RuntimeError, match="not a complete demo model"):
        demo.ensure_demo_model(tmp_path)


def test_cache_dir_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.ENV_CACHE_DIR, str(tmp_path / "cache"))
    assert env.cache_dir() == tmp_path / "cache"
    monkeypatch.setenv(env.ENV_CACHE_DIR, "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert env.cache_dir() == tmp_path / ".cache" / "pdserve"


def test_cli_prints_only_the_path(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.engine.demo", "--cache-dir", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
    )
    assert result.stdout == f"{tmp_path / demo.DEMO_MODEL_NAME}\n"
    assert (tmp_path / demo.DEMO_MODEL_NAME / "manifest.json").is_file()


def test_loads_in_transformers_and_generates_varied_text(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (4, 128, 352)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == demo_tok.VOCAB_SIZE
    tokenizer = Tokenizer.from_pretrained(model_dir)
    completions = []
    for prompt in ("Hello", "The quick brown fox", "1234"):
        input_ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            output = model.generate(input_ids, max_new_tokens=32, do_sample=False)
        new_ids = output[0, input_ids.shape[1] :].tolist()
        assert len(new_ids) == 32
        assert len(set(new_ids)) >= 12, new_ids
        printable = [i for i in new_ids if i == ord("\n") or 0x20 <= i < 0x7F]
        assert len(printable) >= 24, new_ids
        completions.append(new_ids)
    assert len({tuple(c) for c in completions}) == len(completions)


def test_tokenizer_agrees_with_transformers(model_dir: Path) -> None:
    ours = Tokenizer.from_pretrained(model_dir)
    theirs = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Sé breve 👋"}, {"role": "user", "content": "Hi"}]
    for text in ("plain", "naïve 日本語 👨‍👩‍👧", "<|user|>inline special"):
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode_chat(messages) == theirs.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False
    )
    assert ours.eos_token_ids == (demo_tok.EOS_TOKEN_ID, demo_tok.END_TOKEN_ID)


def test_the_moe_demo_is_a_mixtral_that_equals_transformers(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from pdserve.engine import LLMEngine, SamplingParams
    from pdserve.engine.config import CacheConfig, EngineConfig

    moe_dir = demo.ensure_demo_model(tmp_path_factory.mktemp("moe"), demo.DEMO_MOE_SPEC)
    assert moe_dir.name == "demo-mixtral-v1"
    manifest = json.loads((moe_dir / "manifest.json").read_text())
    assert manifest["name"] == "demo-mixtral-v1"
    assert manifest["weights_sha256"] == demo.weights_sha256(demo.build_weights(demo.DEMO_MOE_SPEC))
    assert json.loads((moe_dir / "config.json").read_text())["num_local_experts"] == 4
    prompt = Tokenizer.from_pretrained(moe_dir).encode("The quick brown fox")
    config = EngineConfig(model=str(moe_dir), dtype="float32", cache=CacheConfig(num_blocks=16))
    engine = LLMEngine(config)
    ours = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0]
    reference = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0
        )
    assert ours == out[0, len(prompt) :].tolist()[: len(ours)]
