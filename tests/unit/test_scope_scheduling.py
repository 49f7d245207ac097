"""How `make test` orders its scopes (`support.scheduling`): a clean clone schedules by the
committed seconds, a checkout's own last run overrides them, and every scope the committed file
names still exists (a renamed module would otherwise fall back to a guess unnoticed)."""

from __future__ import annotations

import json
from pathlib import Path

from support import scheduling

TESTS = Path(__file__).resolve().parents[1]


def test_a_clean_clone_takes_the_committed_seconds_and_a_run_overrides_them() -> None:
    committed = json.loads(scheduling.COMMITTED_SECONDS.read_text())
    assert committed, "tests/support/scope_seconds.json is empty"
    costliest = max(committed, key=committed.__getitem__)
    assert scheduling.timed_seconds({}) == committed
    timed = scheduling.timed_seconds({costliest: 0.5, "tests/new_module.py": 3.0})
    assert timed[costliest] == 0.5
    assert timed["tests/new_module.py"] == 3.0


def test_the_committed_scopes_name_modules_that_exist() -> None:
    committed = json.loads(scheduling.COMMITTED_SECONDS.read_text())
    missing = [
        scope
        for scope in committed
        if scope != scheduling.SMOLLM2_PROCESSES_SCOPE
        and not (TESTS.parent / scheduling.module_of(scope)).exists()
    ]
    assert not missing, f"refresh with `make scope-seconds` after a make test: {missing}"
