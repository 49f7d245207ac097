"""The demo model: a tiny random-weight Llama generated locally, identical on every machine.

``ensure_demo_model()`` writes a Hugging Face model directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``) into the cache the first time and reuses it afterwards, so a
fresh CPU machine can serve without downloading anything. Run
``python -m pdserve.engine.demo [--cache-dir DIR]`` to create it and print its path.

The weights (`demo_weights`) are the same bytes on every platform; ``manifest.json`` records
their digest so prefill and decode instances can check that they serve the same model.
``demo-moe`` (`DEMO_MOE_SPEC`) is the same as a tiny Mixtral.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
from safetensors.torch import save_file

from pdserve.common.env import cache_dir as default_cache_dir
from pdserve.engine import demo_tokenizer as tok
from pdserve.engine.demo_weights import (
    DEMO_MODEL_NAME,
    DEMO_MOE_MODEL_NAME,
    DEMO_MOE_SPEC,
    DEMO_SPEC,
    DemoModelSpec,
    build_weights,
    weights_sha256,
)

__all__ = [
    "DEMO_MODEL_NAME",
    "DEMO_MOE_MODEL_NAME",
    "DEMO_MOE_SPEC",
    "DEMO_SPEC",
    "DemoModelSpec",
    "build_weights",
    "ensure_demo_model",
    "weights_sha256",
    "write_demo_model",
]

MANIFEST_FILE = "manifest.json"

log = structlog.get_logger()


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_demo_model(directory: Path, spec: DemoModelSpec = DEMO_SPEC) -> str:
    """Writes every file of the demo model into an existing, empty `directory`.

    Returns:
        The weights digest (see `weights_sha256`), also recorded in ``manifest.json``.
    """
    weights = build_weights(spec)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _write_json(directory / "config.json", spec.hf_config())
    _write_json(
        directory / "generation_config.json",
        {
            "bos_token_id": tok.BOS_TOKEN_ID,
            "eos_token_id": [tok.EOS_TOKEN_ID, tok.END_TOKEN_ID],
            "pad_token_id": tok.PAD_TOKEN_ID,
        },
    )
    (directory / "tokenizer.json").write_text(
        tok.build_demo_tokenizer().to_str(pretty=True) + "\n", encoding="utf-8"
    )
    _write_json(directory / "tokenizer_config.json", tok.tokenizer_config())
    digest = weights_sha256(weights)
    files = {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
    }
    # NOTE: the manifest is written last; its presence marks a complete directory.
    manifest = {"name": spec.name, "weights_sha256": digest, "files": files}
    _write_json(directory / MANIFEST_FILE, manifest)
    for path in directory.iterdir():
        path.chmod(0o644)  # NOTE: readable by services running as other users
    return digest


def ensure_demo_model(cache_dir: Path | None = None, spec: DemoModelSpec = DEMO_SPEC) -> Path:
    """Returns the demo model directory, generating it on first use.

    The model is written to a temporary directory next to the target and renamed into place,
    so concurrent processes never see a partial model; the loser of a race discards its copy.

    Args:
        cache_dir: Where to keep it; defaults to `pdserve.common.env.cache_dir()`
            (``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``).
        spec: Which demo: `DEMO_SPEC` (Llama) or `DEMO_MOE_SPEC` (Mixtral).

    Returns:
        ``<cache_dir>/<spec.name>`` (``demo-llama-v1``), a Hugging Face model directory.

    Raises:
        RuntimeError: If the target exists but is not a complete demo model.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = spec.name
    target = root / name
    if (target / MANIFEST_FILE).is_file():
        return target
    if target.exists():
        raise RuntimeError(f"{target} exists but is not a complete demo model; delete it")
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private
        digest = write_demo_model(staging, spec)
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / MANIFEST_FILE).is_file():
                raise
            log.info("demo_model_reused", path=str(target))
            return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("demo_model_written", path=str(target), weights_sha256=digest)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: generates the demo model if needed and prints its directory on stdout."""
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.engine.demo",
        description="Create the tiny deterministic demo model (if needed) and print its path.",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="cache directory (default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve)",
    )
    args = parser.parse_args(argv)
    # NOTE: stdout carries only the path (scripts capture it); log events go to stderr.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    print(ensure_demo_model(args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
