"""Resolving ``--model``: known names, GGUF files, directories, and a cache that heals itself."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from support.gguf_files import NUM_LAYERS, write_tiny_gguf

from pdserve.engine import model_store
from pdserve.engine.model_store import DEFAULT_MODEL, KNOWN_MODELS, known_gguf_path, resolve_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama.cpp GGUF: preparing it takes milliseconds, SmolLM2's 93 MB take seconds."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


@pytest.fixture
def fetches(monkeypatch: pytest.MonkeyPatch, tiny_gguf: Path) -> list[Path]:
    """The default model stands for a tiny GGUF (its pinned digest that file's), and the
    registry download is a copy of it; records calls."""
    calls: list[Path] = []
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    known = dataclasses.replace(KNOWN_MODELS[DEFAULT_MODEL], gguf_sha256=digest)
    monkeypatch.setitem(KNOWN_MODELS, DEFAULT_MODEL, known)

    def fake_fetch(known: model_store.KnownModel, gguf_path: Path) -> None:
        calls.append(gguf_path)
        shutil.copyfile(tiny_gguf, gguf_path)

    monkeypatch.setattr(model_store, "_fetch", fake_fetch)
    return calls


def test_an_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as error:
        resolve_model("no-such-model", tmp_path)
    message = str(error.value)
    assert "no-such-model" in message and DEFAULT_MODEL in message and ".gguf" in message


def test_a_damaged_gguf_is_fetched_again_then_reused(tmp_path: Path, fetches: list[Path]) -> None:
    # NOTE: known_gguf_path is where a fetch lands and what is reused (the GPU kit places the
    # GGUF there on a machine without a registry).
    gguf_path = known_gguf_path(KNOWN_MODELS[DEFAULT_MODEL], tmp_path)
    gguf_path.parent.mkdir(parents=True)
    gguf_path.write_bytes(b"GGUF but not really")
    resolved = resolve_model(None, tmp_path)
    assert fetches == [gguf_path]
    assert resolved.name == DEFAULT_MODEL
    assert (
        json.loads((resolved.path / "config.json").read_text())["num_hidden_layers"] == NUM_LAYERS
    )
    again = resolve_model(DEFAULT_MODEL, tmp_path)
    assert again == resolved and len(fetches) == 1
    # NOTE: the prepared directory alone also serves under the model's name.
    assert resolve_model(str(resolved.path), tmp_path).name == DEFAULT_MODEL


def test_an_incomplete_preparation_is_redone(tmp_path: Path, fetches: list[Path]) -> None:
    resolved = resolve_model(DEFAULT_MODEL, tmp_path)
    weights = resolved.path / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as handle:
        handle.truncate(size // 2)
    assert resolve_model(DEFAULT_MODEL, tmp_path).path == resolved.path
    assert weights.stat().st_size == size
    assert len(fetches) == 1


def test_a_gguf_file_is_prepared_once_under_its_stem(tmp_path: Path, tiny_gguf: Path) -> None:
    cache = tmp_path / "cache"
    resolved = resolve_model(str(tiny_gguf), cache)
    assert resolved.name == tiny_gguf.stem
    assert resolved.path.is_relative_to(cache / "gguf")
    stamp = (resolved.path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(tiny_gguf), cache) == resolved
    assert (resolved.path / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_directory_is_served_as_it_is(tiny_model_dir: Path, tmp_path: Path) -> None:
    resolved = resolve_model(str(tiny_model_dir), tmp_path)
    assert resolved.path == tiny_model_dir and resolved.name == tiny_model_dir.name
    assert not (tmp_path / "models").exists()
