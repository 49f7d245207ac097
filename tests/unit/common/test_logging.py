from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from pdserve.common.logging import configure_logging, get_logger


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def test_json_lines_carry_service_and_bound_context(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("decode", "info")
    structlog.contextvars.bind_contextvars(request_id="req-1")
    try:
        get_logger().info("lease_granted", num_blocks=3)
        get_logger().debug("hidden_detail")
    finally:
        structlog.contextvars.clear_contextvars()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == 1
    assert lines[0]["event"] == "lease_granted"
    assert lines[0]["service"] == "decode"
    assert lines[0]["request_id"] == "req-1"
    assert lines[0]["num_blocks"] == 3
    assert lines[0]["level"] == "info"


def test_unknown_level_is_refused() -> None:
    with pytest.raises(ValueError, match="log level"):
        configure_logging("gateway", "loud")


def test_a_logger_made_before_configuration_follows_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = get_logger("pdserve.launcher.supervisor")  # as a module's ``log``, at import
    configure_logging("pdserve", "info", json=False)
    log.info("service_restarted", service="gateway", pid=12)
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert "service_restarted" in line and "pid=12" in line
    assert "\x1b[" not in line, "colour codes in a log that is not a terminal"


def test_a_broken_stderr_pipe_sends_the_lines_to_a_stdout_file_instead_of_raising(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NOTE: a supervisor that read the service's stderr is gone: its pipe has no reader.
    read_end, write_end = os.pipe()
    os.close(read_end)
    broken = os.fdopen(write_end, "w")
    log_file = (tmp_path / "service.log").open("w", buffering=1)
    monkeypatch.setattr(sys, "stderr", broken)
    monkeypatch.setattr(sys, "stdout", log_file)
    configure_logging("decode", "info")
    get_logger("pdserve.decode").info("before_the_break_is_seen", n=1)
    get_logger("pdserve.decode").warning("after_it", n=2)
    assert sys.stderr is log_file
    lines = [json.loads(line) for line in (tmp_path / "service.log").read_text().splitlines()]
    assert [(line["event"], line["n"]) for line in lines] == [
        ("before_the_break_is_seen", 1),
        ("after_it", 2),
    ]
    with contextlib.suppress(OSError):
        broken.close()  # NOTE: its buffer still holds the line it could not write


def test_a_broken_stderr_without_a_stdout_file_drops_the_lines(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)
    broken = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stderr", broken)
    configure_logging("gateway", "info")
    get_logger().info("nobody_reads_this")  # NOTE: would raise BrokenPipeError before
    assert sys.stderr is not broken and sys.stderr.name == os.devnull
    assert "nobody_reads_this" not in capsys.readouterr().out
    with contextlib.suppress(OSError):
        broken.close()
