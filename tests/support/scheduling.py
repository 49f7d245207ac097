"""How `make test` (``pytest -n 3 --dist loadscope``) shares the suite's work between workers.

xdist's loadscope keeps a module's (or a class's) tests on one worker and hands out those scopes
in order of their number of tests, most first. On this suite that order is the wrong way round:
the end-to-end modules start clusters and have few tests each, so they were handed out last,
and one worker spent the run's last minute alone on a cluster module while the other had
nothing left. The scheduler here hands out the scope that took longest in the last run first
(each scope's seconds are kept in pytest's cache), so the many short unit scopes fill the end;
without a cache (or for a new scope) it guesses from where the module lives: end-to-end first,
then integration, then the rest.

A clean clone (CI's) has no cache: it takes the seconds of `scope_seconds.json` beside this
module, a run's cache as committed (refresh it with `make scope-seconds` after a run that moved
them), and the cache's own where it has them.

It also makes the modules that only send requests to the session's SmolLM2 cluster
(`SMOLLM2_PROCESSES_MODULES`) one scope: they then run on one worker, which starts that
cluster once instead of once per worker.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SMOLLM2_PROCESSES_MODULES = (
    "tests/e2e/test_real_model.py",
    "tests/e2e/test_real_model_sampling.py",
    "tests/e2e/test_real_model_tools.py",
    "tests/e2e/test_responses_api.py",
    "tests/e2e/test_structured_outputs.py",
)
SMOLLM2_PROCESSES_SCOPE = "smollm2-processes"
CACHE_KEY = "pdserve/scope-seconds"
COMMITTED_SECONDS = Path(__file__).with_name("scope_seconds.json")

# NOTE: a scope's guessed seconds when no earlier run timed it, by the folder its module is in.
GUESSED_SECONDS = {"tests/e2e/": 30.0, "tests/integration/": 5.0}
GUESSED_SECONDS_ELSEWHERE = 1.0
GUESSED_SECONDS_PER_TEST = 0.05


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def scope_of(nodeid: str) -> str:
    """loadscope's scope of a test (its module, or its class), except that the modules of
    `SMOLLM2_PROCESSES_MODULES` are one scope."""
    if module_of(nodeid) in SMOLLM2_PROCESSES_MODULES:
        return SMOLLM2_PROCESSES_SCOPE
    # NOTE: the parameters first: an id may hold "::" (an IPv6 address).
    return nodeid.split("[", 1)[0].rsplit("::", 1)[0]


def guessed_seconds(scope: str, num_tests: int) -> float:
    """What a scope no earlier run timed is taken to cost."""
    if scope == SMOLLM2_PROCESSES_SCOPE:
        return 120.0
    base = next(
        (seconds for folder, seconds in GUESSED_SECONDS.items() if scope.startswith(folder)),
        GUESSED_SECONDS_ELSEWHERE,
    )
    return base + GUESSED_SECONDS_PER_TEST * num_tests


def timed_seconds(cached: Mapping[str, float]) -> dict[str, float]:
    """Each scope's seconds: the committed ones, overridden by this checkout's last run."""
    committed = json.loads(COMMITTED_SECONDS.read_text()) if COMMITTED_SECONDS.exists() else {}
    return {**committed, **cached}


def commit_seconds(cache_dir: Path = Path(".pytest_cache")) -> None:
    """Writes the last run's seconds per scope (pytest's cache under `cache_dir`) as the
    committed ones (``make scope-seconds``)."""
    cached = json.loads((cache_dir / "v" / CACHE_KEY).read_text())
    rounded = {scope: round(seconds, 1) for scope, seconds in sorted(cached.items())}
    COMMITTED_SECONDS.write_text(json.dumps(rounded, indent=1) + "\n")


def make_scheduler(config: Any, log: Any, timed: Mapping[str, float]) -> Any:
    """A loadscope scheduler that hands out the costliest scope left first (`timed`: seconds
    per scope from an earlier run)."""
    from xdist.scheduler import LoadScopeScheduling

    class LongestFirstScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _cost(self, scope: str) -> float:
            if scope in timed:
                return float(timed[scope])
            return guessed_seconds(scope, len(self.workqueue[scope]))

        def _assign_work_unit(self, node: Any) -> None:
            costliest = max(self.workqueue, key=self._cost)
            self.workqueue.move_to_end(costliest, last=False)
            super()._assign_work_unit(node)

    return LongestFirstScheduling(config, log)


class ScopeTimer:
    """Sums each scope's seconds (setup, call and teardown of its tests) in the xdist
    controller and keeps them in pytest's cache for the next run's order."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        scope = scope_of(report.nodeid)
        self.seconds[scope] = self.seconds.get(scope, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        cache = getattr(self.config, "cache", None)
        if cache is None or not self.seconds:
            return
        timed = dict(cache.get(CACHE_KEY, {}))
        timed.update({scope: round(seconds, 2) for scope, seconds in self.seconds.items()})
        cache.set(CACHE_KEY, timed)
