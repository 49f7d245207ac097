from __future__ import annotations

import json
from collections.abc import Iterator

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
