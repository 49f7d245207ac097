"""The fault matrix's bookkeeping (`support.fault_matrix`): `make test` meets every fault and
every phase at least once (its fast cells, and the cells other test files of `make test`
inject), every cell is built, injected elsewhere or not applicable, and no cell is built
twice."""

from __future__ import annotations

from support.fault_matrix import BUILT, ELSEWHERE, FAULTS, PHASES, TARGETS, status_of


def test_make_test_meets_every_fault_and_every_phase() -> None:
    fast = [(c.fault, c.target, c.phase) for c in BUILT if c.fast]
    met = [*fast, *ELSEWHERE]
    assert {fault for fault, _, _ in met} == set(FAULTS)
    assert {phase for _, _, phase in fast} == set(PHASES)


def test_every_applicable_cell_is_built_and_each_once() -> None:
    statuses = {(f, t, p): status_of(f, t, p) for f in FAULTS for t in TARGETS for p in PHASES}
    assert [cell for cell, status in statuses.items() if status == "not built"] == []
    built = [(c.fault, c.target, c.phase, c.variant) for c in BUILT]
    assert len(built) == len(set(built))
