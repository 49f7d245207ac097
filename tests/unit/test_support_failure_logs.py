"""`support.failure_logs`: a failed test's report carries its pdserve processes' last log lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import failure_logs

from pdserve.launcher.child import ChildProcess


def printing_child(tmp_path: Path, name: str, lines: list[str]) -> ChildProcess:
    """A process named `name` that printed `lines` to its log and exited."""
    script = f"import sys\nfor line in {lines!r}: print(line, file=sys.stderr)"
    child = ChildProcess(name, [sys.executable, "-c", script], tmp_path / f"{name}.log")
    assert child.wait(60) == 0
    child.close()
    return child


def logging_child(tmp_path: Path, name: str, num_lines: int) -> ChildProcess:
    return printing_child(tmp_path, name, [f"{name} line {i}" for i in range(num_lines)])


@dataclass
class Holder:
    cluster: object


def test_each_process_once_with_its_last_lines_and_state(tmp_path: Path) -> None:
    long, short = logging_child(tmp_path, "decode-0", 400), logging_child(tmp_path, "gateway", 3)
    tails = failure_logs.pdserve_log_tails({"a": long, "b": Holder(long), "c": short, "d": 7})
    assert tails.count("---- decode-0 (") == 1 and tails.count("---- gateway (") == 1
    assert f"(pid {long.pid}, exited 0)" in tails
    kept = [f"decode-0 line {i}" for i in range(400 - failure_logs.NUM_LINES, 400)]
    assert [line for line in tails.splitlines() if line.startswith("decode-0 line")] == kept
    assert "gateway line 0\ngateway line 1\ngateway line 2" in tails


def test_a_test_that_started_none_adds_nothing() -> None:
    assert failure_logs.pdserve_log_tails({"tmp_path": Path("."), "n": 3}) == ""


def test_the_report_of_a_failed_test_shows_them(tmp_path: Path) -> None:
    # NOTE: the suite's own conftest as a plugin, in a pytest run of its own, with one failing
    # and one passing test that each hold a process (its temp dirs inside this test's: pytest
    # keeps the last three runs' and would rotate the suite's own away).
    tests = Path(__file__).resolve().parents[1]
    cases = tmp_path / "test_cases.py"
    cases.write_text(
        textwrap.dedent(f"""
            import sys
            import pytest
            from pathlib import Path
            from pdserve.launcher.child import ChildProcess

            @pytest.fixture
            def child():
                code = "import sys; print('the decode said why', file=sys.stderr)"
                process = ChildProcess("decode-9", [sys.executable, "-c", code],
                                       Path({str(tmp_path)!r}) / "decode-9.log")
                process.wait(60)
                yield process
                process.close()

            def test_fails(child):
                assert False

            def test_passes(child):
                pass
        """)
    )
    path = os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
         "-p", "no:xdist", f"--basetemp={tmp_path / 'basetemp'}", str(cases)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "1 failed, 1 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("pdserve processes' logs") == 1
    assert "the decode said why" in result.stdout


def json_child(tmp_path: Path, name: str, records: list[dict[str, str]]) -> ChildProcess:
    return printing_child(tmp_path, name, [json.dumps(record) for record in records])


def test_the_report_ends_with_every_process_warnings_merged_by_time(tmp_path: Path) -> None:
    def record(second: int, level: str, event: str) -> dict[str, str]:
        return {"timestamp": f"2026-01-01T00:00:{second:02d}Z", "level": level, "event": event}

    gateway = json_child(
        tmp_path,
        "gateway",
        [record(1, "info", "request_started"), record(4, "warning", "instance_expired")],
    )
    decode = json_child(
        tmp_path,
        "decode-1",
        [record(2, "warning", "registration_failed"), record(5, "info", "registered")],
    )
    tails = failure_logs.pdserve_log_tails({"g": gateway, "d": decode})
    timeline = tails.split("---- warnings and errors of every process, by time\n")[1]
    events = [line.split()[1:4] for line in timeline.splitlines()]
    assert events == [
        ["decode-1", "warning", "registration_failed"],
        ["gateway", "warning", "instance_expired"],
        ["decode-1", "info", "registered"],
    ]


def test_a_process_that_never_logs_the_event_is_reported_with_its_last_lines(
    tmp_path: Path,
) -> None:
    started = json.dumps({"event": "started"})
    code = "import sys, time; print('waiting on the gateway', file=sys.stderr); "
    code += f"print({started!r}, file=sys.stderr, flush=True); time.sleep(600)"
    child = ChildProcess("prefill-0", [sys.executable, "-c", code], tmp_path / "prefill-0.log")
    try:
        child.wait_for_event("started", 60)
        with pytest.raises(RuntimeError) as raised:
            child.wait_for_event("registered", 0.1)
        message = str(raised.value)
        assert message.startswith("prefill-0 (pid ") and "did not log registered" in message
        assert "(still running)" in message and "waiting on the gateway" in message
    finally:
        child.close()
