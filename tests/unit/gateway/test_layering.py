"""The gateway's import structure: no import circle, and no import runs up between its layers.

Every import of a gateway module by another (``TYPE_CHECKING`` imports and imports inside
functions included) is read with ``ast``. Each module belongs to a unit (its sub-package, or
the top-level module's name), each unit to a layer. A module may import its own unit and any
unit of a lower layer; top-level modules of one layer may also import each other (the circle
check still holds them); sub-packages of one layer may not.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[3] / "services/gateway/src/pdserve/gateway"
PACKAGE = "pdserve.gateway"

# Bottom first. Units in one layer may not import each other (only themselves).
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    ("telemetry", frozenset({"metrics", "text"})),
    ("instances", frozenset({"fleet"})),
    ("placement", frozenset({"routing", "access"})),
    ("tool calling", frozenset({"tools"})),
    (
        "request values",
        frozenset({"request", "progress", "phases", "decisions", "active_request"}),
    ),
    ("preparation", frozenset({"prepare", "reasoning"})),
    (
        "request core",
        frozenset(
            {
                "relay",
                "cleanups",
                "attempt_legs",
                "pair_choice",
                "peer_wait",
                "attempt",
                "orchestrator",
                "streaming",
                "frontend",
                "choices",
                "tool_deltas",
                "output_deltas",
            }
        ),
    ),
    ("sessions", frozenset({"session"})),
    ("front ends", frozenset({"openai", "grpc_api"})),
    (
        "process",
        frozenset({"config", "config_fields", "grpc_ports", "server", "__main__", "__init__"}),
    ),
)
LAYER_OF = {unit: index for index, (_, units) in enumerate(LAYERS) for unit in units}


TOP_LEVEL = frozenset(path.stem for path in GATEWAY.glob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(GATEWAY).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join([PACKAGE, *parts])


def unit_of(module: str) -> str:
    return module.removeprefix(PACKAGE + ".").split(".")[0]


def imported_modules(path: Path, known: set[str]) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name in known:
                yield name


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in GATEWAY.rglob("*.py")}
    known = set(paths)
    return {
        module: {name for name in imported_modules(path, known) if name != module}
        for module, path in paths.items()
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


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in sorted(graph.items()):
        unit = unit_of(module)
        for target in sorted(targets):
            target_unit = unit_of(target)
            if target_unit == unit or LAYER_OF[target_unit] < LAYER_OF[unit]:
                continue
            both_top_level = target_unit in TOP_LEVEL and unit in TOP_LEVEL
            if not (both_top_level and LAYER_OF[target_unit] == LAYER_OF[unit]):
                wrong.append(f"{module} -> {target}")
    return wrong


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(module) for module in import_graph()}
    assert units - set(LAYER_OF) == set(), "add the new unit to LAYERS"


def test_no_import_circle() -> None:
    assert find_cycle(import_graph()) is None


def test_no_import_runs_up_or_sideways() -> None:
    assert upward_imports(import_graph()) == []


@pytest.mark.parametrize(
    ("graph", "has_cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
    ],
)
def test_the_cycle_finder_finds_circles(graph: dict[str, set[str]], has_cycle: bool) -> None:
    assert (find_cycle(graph) is not None) == has_cycle


def test_an_upward_import_is_reported() -> None:
    graph = {f"{PACKAGE}.tools.spec": {f"{PACKAGE}.request"}, f"{PACKAGE}.request": set()}
    assert upward_imports(graph) == [f"{PACKAGE}.tools.spec -> {PACKAGE}.request"]
