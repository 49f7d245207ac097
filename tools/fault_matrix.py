"""Prints the fault matrix: every (fault, target, phase) cell, what the last run of each built
cell said, and which cells other test files inject, are not applicable, or are not built.

    .venv/bin/python tools/fault_matrix.py [RESULTS]   # default: what `make chaos` wrote

The cells and the table live in `tests/support/fault_matrix.py`; `make chaos` runs them
(`pytest tests/e2e/test_fault_matrix.py --chaos`) and then this.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.fault_matrix import read_results, render  # noqa: E402

DEFAULT_RESULTS = ROOT / ".pytest_cache/d/fault-matrix/results.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results", nargs="?", type=Path, default=DEFAULT_RESULTS, help="the results file"
    )
    args = parser.parse_args()
    results = read_results(args.results)
    print(render(results))
    return 1 if any(r["outcome"] != "passed" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
