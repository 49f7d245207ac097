"""buf lint and buf breaking gate the contract: clean today, and they fail on bad edits."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASELINE = ROOT / "protos" / "baseline" / "pdserve-v1.binpb"
BUF = shutil.which("buf", path=str(Path(sys.executable).parent)) or shutil.which("buf")

pytestmark = pytest.mark.skipif(BUF is None, reason="buf (PyPI buf-bin) is not installed")


def _buf(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert BUF is not None
    return subprocess.run(
        [BUF, *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=120
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A copy of the buf workspace (buf.yaml + protos) that a test may edit."""
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    return tmp_path


def _edit(workspace: Path, name: str, old: str, new: str) -> None:
    path = workspace / "protos" / "pdserve" / "v1" / name
    text = path.read_text()
    assert old in text, f"{old!r} not found in {name}"
    path.write_text(text.replace(old, new, 1))


def test_lint_and_format_are_clean() -> None:
    lint = _buf("lint", cwd=ROOT)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _buf("format", "--diff", "--exit-code", cwd=ROOT)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_current_contract_is_compatible_with_baseline() -> None:
    result = _buf("breaking", "--against", str(BASELINE), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_adding_a_field_is_compatible(workspace: Path) -> None:
    _edit(
        workspace,
        "decode.proto",
        "  string prefill_instance_id = 6;\n",
        "  string prefill_instance_id = 6;\n  // A new optional field.\n  uint32 priority = 99;\n",
    )
    result = _buf("breaking", "--against", str(BASELINE), cwd=workspace)
    assert result.returncode == 0, result.stdout + result.stderr


def test_removing_a_field_breaks(workspace: Path) -> None:
    _edit(workspace, "decode.proto", "  // Keys: num_blocks blocks", "  // (removed)")
    path = workspace / "protos" / "pdserve" / "v1" / "decode.proto"
    path.write_text(re.sub(r"\n  bytes key = 4;", "", path.read_text()))
    result = _buf("breaking", "--against", str(BASELINE), cwd=workspace)
    assert result.returncode != 0
    assert "key" in result.stdout + result.stderr


def test_renumbering_a_field_breaks(workspace: Path) -> None:
    _edit(workspace, "common.proto", "uint32 max_tokens = 5;", "uint32 max_tokens = 99;")
    result = _buf("breaking", "--against", str(BASELINE), cwd=workspace)
    assert result.returncode != 0
    assert "max_tokens" in result.stdout + result.stderr


def test_lint_rejects_an_undocumented_field(workspace: Path) -> None:
    comment = "  // Tokens per block (equals the KvLayout's block_size).\n"
    _edit(workspace, "decode.proto", comment, "")
    result = _buf("lint", cwd=workspace)
    assert result.returncode != 0
    assert "block_size" in result.stdout + result.stderr
