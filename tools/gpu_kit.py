"""Gathers the GPU kit (``make gpu-kit``): everything `tools/gpu_check.sh` needs on a bare GPU
machine that has Python 3.12 with a CUDA torch and no network.

    .venv/bin/python tools/gpu_kit.py                 # the kit for the lent GPU, into .gpukit/
    .venv/bin/python tools/gpu_kit.py --rehearsal --out DIR
                                                      # this Python, project wheels only, offline

The kit holds:

* the Python 3.12 manylinux wheels of every runtime dependency of the four distributions that
  the GPU image lacks (tools/gpu_image_packages.txt), walked from the installed
  distributions' metadata and pinned by constraints.txt; torch, its CUDA libraries and Triton
  are never carried, and the image's own copies of `VERSION_SENSITIVE` packages are
  overridden;
* the project's own wheels (``pip wheel --no-deps`` of shared and the three services);
* the default model's GGUF, which the check prepares into its cache on the machine (the
  prepared float32 checkpoint is five times larger);
* with ``--flash`` (``make gpu-kit GPU_KIT_FLASH=1``), flash-attn 4 and its dependencies
  (`FLASH_PACKAGES`);
* NIXL's CUDA 13 wheel (`nixl_packages`), so that the check moves KV over NIXL VRAM to VRAM
  and measures it (``--no-nixl``, ``make gpu-kit GPU_KIT_NIXL=0``: without it, one call fewer).

One device call carries at most 64 MiB, the working tree included, and the GGUF alone is
larger, so the kit is cut into parts (``part1``, ``part2``, ...) that each fit beside the
tree: files that do not fit are split into pieces. Every part holds the manifest
(``kit.json``: each file's digest, size and pieces), and the wheels sit in the last part, so
a check that received only the last part still installs and runs (on the demo model, without
flash-attn). The parts are carried one device call each, in order, the last with the check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pdserve.engine.model_store import DEFAULT_MODEL, KNOWN_MODELS, known_gguf_path, resolve_model

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
CARRY_LIMIT = 64 * MIB
"""What one device call may carry: the working tree plus the carried paths."""
MARGIN = 4 * MIB
"""Room left for the tree to grow between building the kit and using it."""
PYTHON_VERSION = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
    # last, so that a wheel for an older glibc wins; llguidance ships only these
    "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
)  # fmt: skip
DISTRIBUTIONS = {
    "pdserve-shared": ROOT / "shared",
    "pdserve-gateway": ROOT / "services" / "gateway",
    "pdserve-prefill": ROOT / "services" / "prefill",
    "pdserve-decode": ROOT / "services" / "decode",
}
EXTRAS = {"pdserve-shared": ("engine",)}
FLASH_PACKAGES = {
    # NOTE: flash-attn 4 (the CuTe DSL kernels, compiled on first use) and what it needs beyond
    # the image: about 96 MiB, nearly all of it the CUDA 13 build of the CuTe DSL compiler.
    "flash-attn-4": "4.0.0b36",
    "nvidia-cutlass-dsl": "4.8.1",
    "nvidia-cutlass-dsl-libs-base": "4.8.1",
    "nvidia-cutlass-dsl-libs-cu13": "4.8.1",
    "apache-tvm-ffi": "0.1.15.post2",
    "torch-c-dlpack-ext": "0.1.5",
    "quack-kernels": "0.6.5",
}
"""With ``--flash``: flash-attn 4 for the engine's flash path (two more parts, two more calls)."""
NIXL_EXTRA = "nixl-cu12"
"""What the ``nixl`` extra installs here (the CUDA 12 build, which also runs without CUDA)."""
NIXL_GPU_WHEEL = "nixl-cu13"
"""NIXL's build for the GPU image's CUDA 13 torch (UCX with its CUDA transports inside)."""
CHECK_REQUIREMENTS = ("pytest-asyncio",)
"""What the check itself runs that the image lacks (the test suite's asyncio plugin)."""

IMAGE_PACKAGES_FILE = Path(__file__).resolve().parent / "gpu_image_packages.txt"
"""The GPU image's Python packages (no versions: one whose version matters is carried anyway)."""
VERSION_SENSITIVE = frozenset({
    # NOTE: the generated pdserve.v1 code refuses an older protobuf runtime or grpcio than the
    # one it was generated with, and grpcio's companions must match grpcio exactly.
    "protobuf", "grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-status",
})  # fmt: skip


def image_packages() -> frozenset[str]:
    """The names of `IMAGE_PACKAGES_FILE`, normalized."""
    lines = IMAGE_PACKAGES_FILE.read_text().splitlines()
    return frozenset(canonicalize_name(line) for line in lines if line and line[0] != "#")


def is_never_carried(name: str) -> bool:
    """torch, its CUDA libraries and Triton come with the image's CUDA build: never carried."""
    return name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-"))


def pinned_versions(constraints: Path) -> dict[str, str]:
    """``name -> version`` of every ``name==version`` line of constraints.txt."""
    pins = {}
    for line in constraints.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version.strip()
    return pins


def _requirements(name: str, extras: tuple[str, ...]) -> list[Requirement]:
    environment = {"python_version": PYTHON_VERSION, "sys_platform": "linux"}
    kept = []
    for line in metadata.requires(name) or []:
        requirement = Requirement(line)
        if requirement.marker is None or any(
            Marker(str(requirement.marker)).evaluate({**environment, "extra": extra})
            for extra in ("", *extras)
        ):
            kept.append(requirement)
    return kept


def missing_packages(pins: dict[str, str]) -> dict[str, str]:
    """The dependencies to carry, ``name -> pinned version``: the closure of the four
    distributions' runtime requirements (and the check's own), less what the image has."""
    image = image_packages()
    carried: dict[str, str] = {}
    queue = [Requirement(name) for name in (*DISTRIBUTIONS, *CHECK_REQUIREMENTS)]
    seen: set[str] = set()
    while queue:
        requirement = queue.pop()
        name = canonicalize_name(requirement.name)
        if name in seen or is_never_carried(name):
            continue
        seen.add(name)
        if name in image and name not in VERSION_SENSITIVE:
            continue  # NOTE: the image's copy and its own dependencies serve
        if name not in DISTRIBUTIONS:
            if name not in pins:
                raise SystemExit(f"{name} is needed but constraints.txt does not pin it")
            carried[name] = pins[name]
        queue.extend(_requirements(name, EXTRAS.get(name, tuple(requirement.extras))))
    return dict(sorted(carried.items()))


def nixl_packages(pins: dict[str, str]) -> dict[str, str]:
    """Unless ``--no-nixl``: NIXL's CUDA 13 wheel at the version constraints.txt pins for the
    ``nixl`` extra (about 56 MiB: one more part, one more call). It needs only torch and numpy,
    which the image has."""
    return {NIXL_GPU_WHEEL: pins[NIXL_EXTRA]}


def download(packages: dict[str, str], dest: Path) -> None:
    """The py3.12 manylinux (or pure) wheels of `packages`, without their dependencies; a
    wheel of `dest` that is none of them is removed."""
    for stale in dest.glob("*.whl"):
        if canonicalize_name(re.split(r"-\d", stale.name, maxsplit=1)[0]) not in packages:
            stale.unlink()
    platforms = [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--python-version", PYTHON_VERSION,
               "--implementation", "cp", *platforms, "-d", str(dest),
               *(f"{name}=={version}" for name, version in packages.items())]  # fmt: skip
    subprocess.run(command, check=True)


def build_project_wheels(dest: Path) -> None:
    """``pip wheel --no-deps`` of shared and the three services (no build isolation: the
    venv's setuptools builds them, offline), each pure Python: shared without its CPU kernels,
    which a wheel compiled here would tie to this Python (the GPU image's is another, and pip
    refuses a wheel of another Python) and which the GPU path does not use."""
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "--disable-pip-version-check", "-q", "-w", str(dest),
               *(str(path) for path in DISTRIBUTIONS.values())]  # fmt: skip
    env = {**os.environ, "PDSERVE_CPU_KERNELS": "0"}
    with tempfile.TemporaryDirectory() as scratch:
        # NOTE: setuptools builds in ./build of each project; keep the worktree clean.
        subprocess.run(command, check=True, cwd=scratch, env=env)
    for path in DISTRIBUTIONS.values():
        shutil.rmtree(path / "build", ignore_errors=True)


def tree_bytes() -> int:
    """What a device call sends besides the carried paths: tracked and not-ignored files, and
    the shared/ folder whole."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    files = {ROOT / name for name in listed if name}
    files |= {path for path in (ROOT / "shared").rglob("*")}
    return sum(path.stat().st_size for path in files if path.is_file() and not path.is_symlink())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(MIB):
            digest.update(chunk)
    return digest.hexdigest()


def pack(files: list[tuple[str, str, Path]], out: Path, part_bytes: int) -> dict[str, Any]:
    """Writes `files` (kind, name, path) into out/part1, part2, ..., each at most `part_bytes`,
    splitting a file across parts where it does not fit; returns the manifest."""
    entries: list[dict[str, Any]] = []
    part, used = 1, 0
    for kind, name, path in files:
        size = path.stat().st_size
        pieces: list[list[str]] = []
        with path.open("rb") as source:
            offset = 0
            while offset < size or not pieces:
                if used >= part_bytes:
                    part, used = part + 1, 0
                length = min(size - offset, part_bytes - used)
                piece = name if length == size else f"{name}.piece{len(pieces)}"
                folder = out / f"part{part}"
                folder.mkdir(parents=True, exist_ok=True)
                with (folder / piece).open("wb") as sink:
                    sink.write(source.read(length))
                pieces.append([f"part{part}", piece])
                offset += length
                used += length
        entries.append(
            {"kind": kind, "name": name, "size": size, "sha256": sha256(path), "pieces": pieces}
        )
    parts = sorted({piece[0] for entry in entries for piece in entry["pieces"]})
    return {"parts": parts, "files": entries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpukit")
    parser.add_argument(
        "--rehearsal",
        action="store_true",
        help="for this Python, offline: the project's wheels only (its venv has the rest)",
    )
    parser.add_argument(
        "--part-mib", type=float, help="largest part (default: 64 MiB less the tree and 4 MiB)"
    )
    parser.add_argument("--flash", action="store_true", help="add flash-attn 4 (about 96 MiB)")
    parser.add_argument(
        "--nixl",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="carry NIXL's CUDA 13 wheel (about 56 MiB, one part more; default: yes)",
    )
    args = parser.parse_args()
    out: Path = args.out
    staging = out / "staging"
    for old in out.glob("part*"):
        shutil.rmtree(old)
    shutil.rmtree(staging / "project", ignore_errors=True)
    for folder in ("deps", "flash", "nixl"):
        (staging / folder).mkdir(parents=True, exist_ok=True)
    build_project_wheels(staging / "project")
    files = []
    model: dict[str, str] | None = None
    pins = pinned_versions(ROOT / "constraints.txt")
    # NOTE: the optional wheels first: the last part, which holds the check's own wheels, installs
    # and runs whatever of the earlier parts did not arrive.
    optional = {"flash": FLASH_PACKAGES, "nixl": nixl_packages(pins)}
    for name in ("flash", "nixl"):
        if getattr(args, name) and not args.rehearsal:
            download(optional[name], staging / name)
            files += [("wheel", p.name, p) for p in sorted((staging / name).glob("*.whl"))]
    if not args.rehearsal:
        packages = missing_packages(pins)
        print(f"carrying {len(packages)} dependencies the GPU image lacks: {', '.join(packages)}")
        download(packages, staging / "deps")
        known = KNOWN_MODELS[DEFAULT_MODEL]
        gguf = known_gguf_path(known)
        if not gguf.is_file():
            resolve_model(DEFAULT_MODEL, show_progress=True)
        files.append(("model", gguf.name, gguf))
        model = {"name": known.name, "file": gguf.name, "sha256": known.gguf_sha256}
    files += [("wheel", p.name, p) for p in sorted((staging / "deps").glob("*.whl"))]
    files += [("wheel", p.name, p) for p in sorted((staging / "project").glob("*.whl"))]
    tree = tree_bytes()
    part_bytes = int(args.part_mib * MIB) if args.part_mib else CARRY_LIMIT - tree - MARGIN
    manifest = {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}"
        if args.rehearsal
        else PYTHON_VERSION,
        "model": model,
        **pack(files, out, part_bytes),
    }
    for part in manifest["parts"]:
        (out / part / "kit.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(int(entry["size"]) for entry in manifest["files"])
    print(f"kit: {out} ({total / MIB:.1f} MiB in {len(manifest['parts'])} parts)")
    for part in manifest["parts"]:
        size = sum(p.stat().st_size for p in (out / part).iterdir())
        print(
            f"  {part}: {size / MIB:.1f} MiB; with the tree ({tree / MIB:.1f} MiB) "
            f"{(size + tree) / MIB:.1f} of the 64 MiB a device call carries"
        )
    for kind in ("model", "wheel"):
        size = sum(int(e["size"]) for e in manifest["files"] if e["kind"] == kind)
        print(f"  {kind}s: {size / MIB:.1f} MiB")
    *early, last = manifest["parts"]
    print("on a lent GPU, one device call per part, each at once after the last (docs/gpu.md):")
    for part in early:
        print(f"  carry [.gpukit/{part}]  command: du -sh .gpukit/*  timeout_s: 120")
    print(f"  carry [.gpukit/{last}]  command: bash tools/gpu_check.sh  timeout_s: 600")


if __name__ == "__main__":
    main()
