"""A cheap, stable identity of a model directory, for the KV layout fingerprint.

Hashing every weight byte of a large checkpoint at start-up would cost minutes, so the digest
covers `config.json`, every safetensors header (tensor names, dtypes, shapes, offsets), each
file's size, and a sample of its bytes at the start and the end. Two directories with the same
weights always agree; directories with different weights disagree unless a change leaves all
of those untouched.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

SAMPLE_BYTES = 1 << 16


def model_digest(model_dir: str | Path) -> str:
    """Hex digest (16 characters) of a Hugging Face model directory's identity."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    digest.update((root / "config.json").read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(path.name.encode())
        digest.update(size.to_bytes(8, "little"))
        with path.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            digest.update(handle.read(header_len))
            digest.update(handle.read(SAMPLE_BYTES))
            handle.seek(max(0, size - SAMPLE_BYTES))
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def model_id(served_model_name: str, model_dir: str | Path) -> str:
    """``name@digest``: what KvLayout.model_id carries."""
    return f"{served_model_name}@{model_digest(model_dir)}"
