"""The last lines each pdserve process of a failed test logged, for its report.

A race that a busy machine loses once in many runs must be read from the failure report: the
processes' log files lie in the test's temp directory, which later runs rotate away (and CI
keeps only the output). `pdserve_log_tails` finds the processes among a test's fixture values
(a launcher `Cluster`, a `ChildProcess`, or a value holding one as ``.cluster``).

CI keeps the start and the end of a long output: the report ends with `warnings_timeline`, the
warnings and errors of every process merged by time, short enough to survive the cut.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pdserve.launcher.child import ChildProcess
from pdserve.launcher.cluster import Cluster

NUM_LINES = 150  # per process: the gateway's record of a request spans many lines
MAX_LINE_CHARS = 400
READ_BYTES = 256 * 1024
NUM_TIMELINE_LINES = 60  # the last warnings and errors, all processes together
TIMELINE_LEVELS = frozenset({"warning", "error", "critical"})
TIMELINE_EVENTS = frozenset({"registered", "instance_registered", "instance_down"})
TIMELINE_LINE_CHARS = 300


def children_in(values: Iterable[Any]) -> Iterator[ChildProcess]:
    """The processes `values` started, each once."""
    seen: set[int] = set()
    for value in values:
        found: list[ChildProcess] = []
        cluster = getattr(value, "cluster", value)
        if isinstance(cluster, Cluster):
            found = cluster.children
        elif isinstance(value, ChildProcess):
            found = [value]
        for child in found:
            if id(child) not in seen:
                seen.add(id(child))
                yield child


def tail_of(child: ChildProcess) -> str:
    """The last `NUM_LINES` lines of `child`'s log file, each cut at `MAX_LINE_CHARS` (of an
    exited process, once what it printed last is there)."""
    child.read_to_end()
    try:
        with child.log_path.open("rb") as log:
            size = log.seek(0, 2)
            log.seek(max(0, size - READ_BYTES))
            data = log.read()
    except OSError as error:
        return f"(its log could not be read: {error})"
    lines = data.decode("utf-8", "replace").splitlines()[-NUM_LINES:]
    return "\n".join(line[:MAX_LINE_CHARS] for line in lines)


def warnings_timeline(children: Iterable[ChildProcess]) -> str:
    """The last `NUM_TIMELINE_LINES` warnings and errors the `children` logged (and their
    registrations), merged by time, each line naming its process."""
    lines = []
    for child in children:
        for record in list(child.events):
            level, event = record.get("level"), record.get("event")
            if level not in TIMELINE_LEVELS and event not in TIMELINE_EVENTS:
                continue
            rest = {k: v for k, v in record.items() if k not in ("timestamp", "level", "event")}
            line = f"{record.get('timestamp', '?')} {child.name} {level} {event} "
            line += json.dumps(rest, default=str)
            lines.append(line[:TIMELINE_LINE_CHARS])
    return "\n".join(sorted(lines)[-NUM_TIMELINE_LINES:])


def pdserve_log_tails(funcargs: Mapping[str, Any]) -> str:
    """Each process's state and log tail, for the processes among a test's fixture values,
    then their warnings and errors by time (empty when it started none)."""
    parts = []
    children = list(children_in(funcargs.values()))
    for child in children:
        state = "running" if child.returncode is None else f"exited {child.returncode}"
        parts.append(f"---- {child.name} (pid {child.pid}, {state}): {child.log_path}\n")
        parts.append(tail_of(child) + "\n")
    if children:
        parts.append("---- warnings and errors of every process, by time\n")
        parts.append(warnings_timeline(children) + "\n")
    return "".join(parts)
