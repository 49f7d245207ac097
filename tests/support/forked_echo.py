"""A stand-in service for the fork server's tests, run as ``python -m support.forked_echo MODE``:

* ``exit CODE``: prints its argv and ``PDSERVE_TEST_VALUE`` to stdout, a line to stderr, exits
  with CODE;
* ``event``: logs a JSON ``hello`` event on stderr (as a service logs ``registered``), exits 0;
* ``wait``: prints ``waiting`` and its memory (``/proc/self/smaps_rollup``'s Rss and Pss, kB) as
  JSON on stderr, then sleeps until a signal ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "exit":
        print(json.dumps({"argv": sys.argv, "value": os.environ.get("PDSERVE_TEST_VALUE")}))
        print("to stderr", file=sys.stderr)
        return int(argv[1])
    if mode == "event":
        print(json.dumps({"event": "hello", "pid": os.getpid()}), file=sys.stderr, flush=True)
        return 0
    rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]
    memory = {line.split(":")[0]: int(line.split()[1]) for line in rollup}
    record = {"event": "waiting", "rss_kb": memory["Rss"], "pss_kb": memory["Pss"]}
    print(json.dumps(record), file=sys.stderr, flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
