"""The ``python -m pdserve.engine`` command line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.__main__ import main


def test_cli_generates_the_engines_greedy_tokens(
    checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = checkpoint("qwen2")
    prompt = [5, 9, 200, 17, 33]
    argv = ["--model", str(model_dir), "--prompt-token-ids", ",".join(map(str, prompt))]
    argv += ["--enforce-eager"]  # NOTE: no graphs on CPU anyway; the flag is accepted
    assert main([*argv, "--max-tokens", "12", "--ignore-eos", "--num-blocks", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    engine = LLMEngine(EngineConfig(model=str(model_dir), cache=CacheConfig(num_blocks=32)))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = engine.generate([prompt], params)[0]
    assert lines[0] == "--- prompt (5 tokens), 12 new tokens"
    assert lines[1] == " ".join(map(str, expected))


def test_cli_rejects_bad_settings_and_text_without_tokenizer(
    checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = str(checkpoint("qwen2"))
    assert main(["--model", model_dir, "--prompt", "hello"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert main(["--model", model_dir, "--prompt-token-ids", "5", "--top-p", "0"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_cli_quantization_generates_the_quantized_engines_tokens(
    checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model_dir = checkpoint("qwen2")
    prompt = [5, 9, 200, 17, 33]
    argv = ["--model", str(model_dir), "--prompt-token-ids", ",".join(map(str, prompt))]
    argv += ["--dtype", "bfloat16", "--quantization", "int8", "--num-blocks", "32"]
    assert main([*argv, "--max-tokens", "12", "--ignore-eos"]) == 0
    lines = capsys.readouterr().out.splitlines()
    config = EngineConfig(
        model=str(model_dir),
        dtype="bfloat16",
        quantization="int8",
        cache=CacheConfig(num_blocks=32),
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = LLMEngine(config).generate([prompt], params)[0]
    assert lines[1] == " ".join(map(str, expected))
