"""The house's import graph, read with ``ast``: every import of one of its modules by another
(``TYPE_CHECKING`` imports and imports inside functions included), and a circle finder."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Where each distribution's modules live (the namespace package ``pdserve`` spans them).
SOURCE_ROOTS = (
    ROOT / "shared/src",
    ROOT / "services/gateway/src",
    ROOT / "services/prefill/src",
    ROOT / "services/decode/src",
)
GENERATED = "pdserve.v1"


def module_name(path: Path, source_root: Path) -> str:
    """The dotted name of the module at `path` under `source_root` (a package is its
    ``__init__``'s name)."""
    parts = list(path.relative_to(source_root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def parsed(path: Path) -> ast.Module:
    """The syntax tree of the module at `path`."""
    source = path.read_text(encoding="utf-8")
    # NOTE: CPython 3.11's ast.parse now and then fails with "SystemError: AST constructor
    # recursion depth mismatch" while other threads of the process run (python/cpython#106905,
    # fixed in later releases; seen in full runs, here and in the families test): a parse that
    # met it is tried again.
    for _ in range(2):
        try:
            return ast.parse(source)
        except SystemError:
            continue
    return ast.parse(source)


def imported_modules(path: Path, known: set[str]) -> Iterator[str]:
    """The modules of `known` that the module at `path` imports."""
    for node in ast.walk(parsed(path)):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name in known:
                yield name


def import_graph(paths: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports, among `paths` (module name -> file)."""
    known = set(paths)
    return {
        module: {name for name in imported_modules(path, known) if name != module}
        for module, path in paths.items()
    }


def house_modules() -> dict[str, Path]:
    """Every module of the four distributions but the generated contract code."""
    return {
        module_name(path, root): path
        for root in SOURCE_ROOTS
        for path in root.rglob("*.py")
        if not module_name(path, root).startswith(GENERATED)
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None
