"""One module per model family: the registry finds the modules, each holds all of its family
(no other engine module names one), and a family added as one file is served exact."""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from support.hf_reference import hf_greedy
from support.imports import parsed

import pdserve.engine.families as registry
from pdserve.engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, ScheduledChunk
from pdserve.engine.families import Family, families, family_of, gguf_family

ENGINE = Path(registry.__file__).resolve().parents[1]
FAMILIES = ENGINE / "families"
DOCS = Path(__file__).resolve().parents[3] / "docs" / "models.md"
# NOTE: strings that name a family outside its module for another reason: the demo writes a
# Llama and a Mixtral config.json; a GGUF's tokenizer model "llama" is SentencePiece.
NAMED_ELSEWHERE = {"demo_weights.py": {"llama", "mixtral"}, "gguf_import.py": {"llama"}}
LOGITS_ATOL = 1e-4
NUM_NEW_TOKENS = 40


def family_modules() -> list[Path]:
    return sorted(p for p in FAMILIES.glob("*.py") if not p.name.startswith("_"))


def test_every_module_of_the_package_is_one_family_of_the_registry() -> None:
    modules = family_modules()
    assert [p.stem for p in modules] == list(families())
    for name, family in families().items():
        assert family.model_type == name
        assert family_of(name) is family
    assert len(modules) >= 17


def test_a_gguf_architecture_picks_one_family() -> None:
    for family in families().values():
        if family.gguf is None:
            continue
        metadata = {"general.architecture": family.gguf.architecture}
        if family.gguf.claims is not None:
            metadata[f"{family.gguf.architecture}.expert_count"] = 8
        assert gguf_family(metadata) is family
    assert gguf_family({"general.architecture": "llama"}).model_type == "llama"
    assert gguf_family({"general.architecture": "llama", "llama.expert_count": 8}).model_type == (
        "mixtral"
    )


def _imports(path: Path) -> Iterator[str]:
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


@pytest.mark.parametrize("path", family_modules(), ids=lambda p: p.stem)
def test_a_family_module_imports_no_other_family(path: Path) -> None:
    others = {f"pdserve.engine.families.{p.stem}" for p in family_modules()} - {
        f"pdserve.engine.families.{path.stem}"
    }
    assert not others & set(_imports(path))


def test_no_engine_module_outside_the_families_names_a_family() -> None:
    """A family's knowledge is in its module: no other engine module compares against its
    ``model_type`` or GGUF architecture (what the registry's lookups replaced)."""
    names = set(families()) | {f.gguf.architecture for f in families().values() if f.gguf}
    found = []
    for path in sorted(ENGINE.rglob("*.py")):
        if FAMILIES in path.parents:
            continue
        allowed = NAMED_ELSEWHERE.get(path.name, set())
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Constant) and node.value in names - allowed:
                found.append(f"{path.relative_to(ENGINE)}:{node.lineno} {node.value!r}")
    assert not found


def _doc_section(title: str) -> str:
    text = DOCS.read_text(encoding="utf-8")
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start : end if end != -1 else None]


def test_the_models_page_lists_exactly_the_registry_families() -> None:
    table_rows = re.findall(r"^\| `([\w.-]+)`", _doc_section("## Families"), re.MULTILINE)
    assert sorted(table_rows) == sorted(families())
    gguf_rows = re.findall(r"^\| `([\w.-]+)`", _doc_section("### Architectures"), re.MULTILINE)
    architectures = {f.gguf.architecture for f in families().values() if f.gguf is not None}
    assert set(gguf_rows) == architectures


# A family that needs no new layer: this one file is all it takes (the registry finds it).
ALIAS_MODULE = '''"""A tiny Llama under a model_type of its own: the shared rules are Llama's."""

from pdserve.engine.families import Family

FAMILY = Family("tiny_llama_alias")
'''


@pytest.fixture
def alias_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Family]:
    """The registry with one family more, from one module in a folder of its own."""
    folder = tmp_path / "extra_families"
    folder.mkdir()
    (folder / "tiny_llama_alias.py").write_text(ALIAS_MODULE)
    monkeypatch.setattr(registry, "__path__", [*registry.__path__, str(folder)])
    families.cache_clear()
    try:
        yield family_of("tiny_llama_alias")
    finally:
        sys.modules.pop("pdserve.engine.families.tiny_llama_alias", None)
        monkeypatch.undo()
        families.cache_clear()


def test_a_family_added_as_one_file_is_served_exact_against_transformers(
    alias_family: Family,
    tmp_path: Path,
    checkpoint: Callable[[str], Path],
    hf_model: Callable[[str], torch.nn.Module],
    prompts: Callable[..., list[list[int]]],
) -> None:
    model_dir = tmp_path / "alias"
    shutil.copytree(checkpoint("llama3"), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(
        json.dumps({**config, "model_type": alias_family.model_type})
    )
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), dtype="float32", seed=0, cache=CacheConfig(num_blocks=64)
        )
    )
    assert engine.runner.model.config.model_type == "tiny_llama_alias"
    reference = hf_model("llama3")
    sequence = prompts(1, seed=5, min_len=40, max_len=40)[0]
    chunk = ScheduledChunk(sequence, 0, engine.block_pool.allocate(3))
    with torch.no_grad():
        expected = reference(torch.tensor([sequence])).logits[0, -1]
    torch.testing.assert_close(
        engine.runner.execute([chunk])[0], expected, atol=LOGITS_ATOL, rtol=0
    )
    batch = prompts(3, seed=11, min_len=10, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = engine.generate(batch, params)
    for prompt, output in zip(batch, outputs, strict=True):
        assert output == hf_greedy(reference, prompt, NUM_NEW_TOKENS)


def test_without_its_module_the_family_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'tiny_llama_alias'"):
        family_of("tiny_llama_alias")
    with pytest.raises(ValueError, match="multimodal Gemma 3"):
        family_of("gemma3")
