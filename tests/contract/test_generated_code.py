"""The committed pdserve.v1 code is what the protos generate, and the check notices drift."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOGEN = ROOT / "tools" / "protogen.py"
COMMITTED = ROOT / "shared" / "src"


def _check(committed_root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROTOGEN), "--check", "--committed-root", str(committed_root)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_committed_code_is_fresh() -> None:
    result = _check(COMMITTED)
    assert result.returncode == 0, result.stderr


def test_check_detects_an_edited_file(tmp_path: Path) -> None:
    package = tmp_path / "pdserve" / "v1"
    shutil.copytree(COMMITTED / "pdserve" / "v1", package)
    target = package / "decode_pb2.pyi"
    target.write_text(target.read_text() + "\n# hand edit\n")
    result = _check(tmp_path)
    assert result.returncode == 1
    assert "decode_pb2.pyi" in result.stderr


def test_check_detects_a_missing_file(tmp_path: Path) -> None:
    package = tmp_path / "pdserve" / "v1"
    shutil.copytree(COMMITTED / "pdserve" / "v1", package)
    (package / "registry_pb2_grpc.py").unlink()
    result = _check(tmp_path)
    assert result.returncode == 1
    assert "registry_pb2_grpc.py" in result.stderr
