"""Generate (or check) the pdserve.v1 Python code from protos/ with grpcio-tools.

Usage:
    python tools/protogen.py           # write shared/src/pdserve/v1/*_pb2*.py(i)
    python tools/protogen.py --check   # exit 1 if the committed code differs from a fresh build
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT / "shared" / "src"
PACKAGE_DIR = Path("pdserve") / "v1"
GENERATED_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path) -> None:
    """Run protoc for every pdserve.v1 file, writing the package under `out_root`."""
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf well-known types
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_files(root: Path) -> dict[str, Path]:
    package = root / PACKAGE_DIR
    return {p.name: p for glob in GENERATED_GLOBS for p in package.glob(glob)}


def check(committed_root: Path = OUT_ROOT) -> int:
    """Returns 0 when the code under `committed_root` equals a fresh build, else 1."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = generated_files(Path(tmp))
        committed = generated_files(committed_root)
        stale = sorted(
            name
            for name in fresh.keys() | committed.keys()
            if name not in fresh
            or name not in committed
            or not filecmp.cmp(fresh[name], committed[name], shallow=False)
        )
    if stale:
        print("generated code is stale, run `make proto`:", ", ".join(stale), file=sys.stderr)
        return 1
    print(f"generated code is fresh ({len(fresh)} files)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument(
        "--committed-root",
        type=Path,
        default=OUT_ROOT,
        help="with --check: the source root holding the committed pdserve/v1 package",
    )
    args = parser.parse_args()
    if args.check:
        return check(args.committed_root)
    for path in generated_files(OUT_ROOT).values():
        path.unlink()
    generate(OUT_ROOT)
    print(f"wrote {len(generated_files(OUT_ROOT))} files to {OUT_ROOT / PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
