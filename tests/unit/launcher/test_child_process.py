"""Closing a supervised service ends what it started without leaving its process pool's named
semaphores in /dev/shm (a real service process with a forkserver process pool); the report of
a process that exited holds the last lines it printed."""

from __future__ import annotations

import sys
from pathlib import Path

from pdserve.launcher.child import ChildProcess

# NOTE: as the gateway's parser pool: a forkserver ProcessPoolExecutor that has run a task; the
# names of its queues' semaphores are printed as a JSON event.
SCRIPT = """
import concurrent.futures, json, multiprocessing, sys, time
pool = concurrent.futures.ProcessPoolExecutor(
    1, mp_context=multiprocessing.get_context("forkserver"))
pool.submit(abs, -1).result()
locks = [pool._call_queue._rlock, pool._call_queue._wlock, pool._call_queue._sem,
         pool._result_queue._rlock, pool._result_queue._wlock]
names = [lock._semlock.name for lock in locks]
print(json.dumps({"event": "pool_ready", "semaphores": names}), file=sys.stderr, flush=True)
time.sleep(600)
"""


def test_closing_a_service_unlinks_its_process_pools_semaphores(tmp_path: Path) -> None:
    child = ChildProcess("pool", [sys.executable, "-c", SCRIPT], tmp_path / "pool.log")
    files: list[Path] = []
    try:
        event = child.wait_for_event("pool_ready", 120)
        files = [Path("/dev/shm", "sem." + name.lstrip("/")) for name in event["semaphores"]]
        assert files and all(f.exists() for f in files), files
    finally:
        child.close()
    assert child.returncode is not None
    assert [f for f in files if f.exists()] == []


def test_the_report_of_an_exited_process_ends_with_its_last_line(tmp_path: Path) -> None:
    # NOTE: a burst of lines, then the exit: the thread that copies them to the log is still
    # at work when the process is gone, as it was for a crash's traceback on a busy machine.
    script = "import sys\nfor i in range(30000): print(f'line {i}', file=sys.stderr)\n"
    script += "print('the last line', file=sys.stderr)"
    child = ChildProcess("burst", [sys.executable, "-c", script], tmp_path / "burst.log")
    try:
        assert child.wait(60) == 0
        report = child.describe_exit()
        assert report.rstrip().endswith("the last line"), report[-200:]
        assert child.read_to_end(0) and child.tail[-1] == "the last line"
        assert (tmp_path / "burst.log").read_text().endswith("the last line\n")
    finally:
        child.close()
