"""No import circle anywhere in the house: shared, gateway, prefill and decode, every import
counted (``TYPE_CHECKING`` ones and imports inside functions too: a circle closed only by an
annotation or a deferred import is still two modules that cannot be read apart)."""

from __future__ import annotations

import pytest
from support.imports import find_cycle, house_modules, import_graph


def test_the_house_has_no_import_circle() -> None:
    graph = import_graph(house_modules())
    assert len(graph) > 250  # every distribution was read
    assert find_cycle(graph) is None


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
