"""`pdserve.common.supervisor`: a service named a supervisor stops once that process exits."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from pdserve.common.supervisor import SUPERVISOR_PID_ENV, supervised_env, watch_supervisor

# NOTE: only bounds a run that goes wrong; the watch wakes on the exit itself.
GONE_WAIT_S = 60


def test_the_supervised_environment_names_this_process() -> None:
    env = supervised_env({"A": "1"})
    assert env == {"A": "1", SUPERVISOR_PID_ENV: str(os.getpid())}
    assert supervised_env()[SUPERVISOR_PID_ENV] == str(os.getpid())


async def test_the_watch_fires_once_the_supervisor_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    supervisor = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                  stdin=subprocess.PIPE)  # fmt: skip
    monkeypatch.setenv(SUPERVISOR_PID_ENV, str(supervisor.pid))
    gone = asyncio.Event()
    unwatch = watch_supervisor(asyncio.get_running_loop(), gone.set)
    try:
        await asyncio.sleep(0.05)
        assert not gone.is_set()  # NOTE: alive: nothing fires
        supervisor.kill()
        await asyncio.wait_for(gone.wait(), GONE_WAIT_S)
    finally:
        unwatch()
        unwatch()  # NOTE: a second stop does nothing
        supervisor.kill()
        supervisor.wait()


async def test_a_supervisor_gone_before_the_watch_fires_it_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    monkeypatch.setenv(SUPERVISOR_PID_ENV, str(ended.pid))
    gone = asyncio.Event()
    watch_supervisor(asyncio.get_running_loop(), gone.set)()
    await asyncio.wait_for(gone.wait(), GONE_WAIT_S)


@pytest.mark.parametrize("value", [None, "", "not-a-pid", "-1", "99999999999999999999"])
async def test_without_a_supervisor_nothing_is_watched(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(SUPERVISOR_PID_ENV, raising=False)
    else:
        monkeypatch.setenv(SUPERVISOR_PID_ENV, value)
    gone = asyncio.Event()
    unwatch = watch_supervisor(asyncio.get_running_loop(), gone.set)
    await asyncio.sleep(0.05)
    unwatch()
    assert not gone.is_set()
