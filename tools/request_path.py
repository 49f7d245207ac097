"""Which gateway modules run code while one streaming chat request is served.

Starts a gateway with one fake prefill and decode (`tests/support/threaded_gateway.py`) on a
thread of its own, profiles every thread of this process, and sends one streaming
``POST /v1/chat/completions`` (greedy, 16 tokens). A module counts when a function defined in
it is called in that window; the registry's heartbeat handling in the same window is counted
too (it is small and runs on the same loop). Prints the modules, then "N of M gateway modules".

With ``--per-token`` it counts calls instead: one request of 8 tokens, one of 40, and the
modules whose functions were called at least once more per extra token are those on the
spine of every streamed token after the first (what a long stream pays per token).

    .venv/bin/python tools/request_path.py [--json] [--per-token]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

GATEWAY = ROOT / "services/gateway/src/pdserve/gateway"
PACKAGE = "pdserve.gateway"

SHORT_TOKENS, LONG_TOKENS = 8, 40
_seen: set[str] = set()
_calls: dict[str, int] = {}
_recording = False


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if _recording and event == "call":
        name = frame.f_globals.get("__name__", "")
        if name.startswith(PACKAGE):
            _seen.add(name)
            _calls[name] = _calls.get(name, 0) + 1


def gateway_modules() -> list[str]:
    """Every hand-written module of the gateway package, by dotted name."""
    names = []
    for path in sorted(GATEWAY.rglob("*.py")):
        parts = path.relative_to(GATEWAY).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join((PACKAGE, *parts)))
    return names


def main() -> None:
    global _recording
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a list")
    parser.add_argument(
        "--per-token",
        action="store_true",
        help="the modules called once more (at least) for each streamed token",
    )
    args = parser.parse_args()

    import httpx
    from support.gateway_fakes import MODEL_NAME
    from support.threaded_gateway import ThreadedCluster

    threading.setprofile(_profile)
    sys.setprofile(_profile)
    cluster = ThreadedCluster().start()
    try:
        url = f"{cluster.cluster.base_url}/v1/chat/completions"
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 16,
            "temperature": 0.0,
            "stream": True,
        }
        with httpx.Client(timeout=30.0) as client:

            def record(max_tokens: int) -> dict[str, int]:
                global _recording
                _calls.clear()
                _recording = True
                response = client.post(url, json={**body, "max_tokens": max_tokens})
                _recording = False
                response.raise_for_status()
                assert "[DONE]" in response.text, "the stream did not end"
                return dict(_calls)

            # NOTE: one request first, unrecorded, so lazy imports and caches are warm.
            client.post(url, json=body).raise_for_status()
            short = record(SHORT_TOKENS)
            long = record(LONG_TOKENS) if args.per_token else {}
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        cluster.stop()
    every = gateway_modules()
    crossed = sorted(name for name in _seen if name in every)
    if args.per_token:
        extra = LONG_TOKENS - SHORT_TOKENS
        crossed = sorted(name for name in every if long.get(name, 0) - short.get(name, 0) >= extra)
    if args.json:
        print(json.dumps({"modules": crossed, "num_crossed": len(crossed), "num_all": len(every)}))
        return
    for name in crossed:
        print(name)
    what = "run for each streamed token" if args.per_token else "on the path"
    print(f"{len(crossed)} of {len(every)} gateway modules {what}")


if __name__ == "__main__":
    main()
