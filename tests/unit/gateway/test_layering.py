"""The gateway's import structure: no import circle, and no import runs up between its layers.

Every import of a gateway module by another (``TYPE_CHECKING`` imports and imports inside
functions included) is read with ``ast`` (`support.imports`; `tests/unit/test_import_circles.py`
holds the whole house to no circle). Each module belongs to a unit (its sub-package, or
the top-level module's name), each unit to a layer. A module may import its own unit and any
unit of a lower layer; top-level modules of one layer may also import each other (the circle
check still holds them); sub-packages of one layer may not.
"""

from __future__ import annotations

from pathlib import Path

from support.imports import find_cycle, import_graph, module_name

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
        frozenset({"config", "grpc_ports", "server", "__main__", "__init__"}),
    ),
)
LAYER_OF = {unit: index for index, (_, units) in enumerate(LAYERS) for unit in units}


TOP_LEVEL = frozenset(path.stem for path in GATEWAY.glob("*.py"))


def import_graph_of_the_gateway() -> dict[str, set[str]]:
    src = GATEWAY.parents[1]
    return import_graph({module_name(path, src): path for path in GATEWAY.rglob("*.py")})


def unit_of(module: str) -> str:
    if module == PACKAGE:
        return "__init__"
    return module.removeprefix(PACKAGE + ".").split(".")[0]


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
    units = {unit_of(module) for module in import_graph_of_the_gateway()}
    assert units - set(LAYER_OF) == set(), "add the new unit to LAYERS"


def test_no_import_circle() -> None:
    assert find_cycle(import_graph_of_the_gateway()) is None


def test_no_import_runs_up_or_sideways() -> None:
    assert upward_imports(import_graph_of_the_gateway()) == []


def test_an_upward_import_is_reported() -> None:
    graph = {f"{PACKAGE}.tools.spec": {f"{PACKAGE}.request"}, f"{PACKAGE}.request": set()}
    assert upward_imports(graph) == [f"{PACKAGE}.tools.spec -> {PACKAGE}.request"]
