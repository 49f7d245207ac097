"""A streamed token's path through the gateway stays short: `tools/request_path.py --per-token`
(a profiler over a gateway with a fake prefill and decode) finds at most 8 gateway modules whose
code runs once more for each extra token of a plain chat stream, and none of them is a level
that only hands the token on (the orchestrator's loop)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULES = 8


def test_a_streamed_token_crosses_few_gateway_modules() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools/request_path.py"), "--per-token", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    modules = found["modules"]
    assert "pdserve.gateway.streaming" in modules  # NOTE: the profiler saw the path at all
    assert "pdserve.gateway.orchestrator" not in modules
    assert found["num_crossed"] <= MAX_MODULES, modules
