"""The fork server (`pdserve.launcher.forkserver`): services forked from one process that
imported their modules, with their own arguments, environment, output, session and exit
status, and the pages of what it imported shared."""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.eventually import eventually

from pdserve.launcher import cluster as cluster_module
from pdserve.launcher.child import ChildProcess
from pdserve.launcher.cluster import Cluster
from pdserve.launcher.config import ClusterConfig
from pdserve.launcher.forkserver import ForkServer, ForkServerError

TESTS_DIR = Path(__file__).resolve().parents[2]
SERVICE = "support.forked_echo"


def env_with_tests(**extra: str) -> dict[str, str]:
    """This environment with the tests' folder importable (`support.forked_echo`)."""
    path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    started = ForkServer(tmp_path / "fork-server.log", env_with_tests(), preload=("support",))
    yield started
    started.close()


def test_a_forked_service_gets_its_args_env_output_and_exit_status(
    server: ForkServer, tmp_path: Path
) -> None:
    stdout_path = tmp_path / "out.log"
    read_end, write_end = os.pipe()
    with stdout_path.open("w") as stdout:
        process = server.spawn(
            SERVICE, ["exit", "3"], env_with_tests(PDSERVE_TEST_VALUE="forked"), stdout.fileno(),
            write_end,
        )  # fmt: skip
    os.close(write_end)
    with os.fdopen(read_end) as stderr:
        assert stderr.read() == "to stderr\n"
    assert process.wait(30) == 3
    assert process.poll() == 3
    printed = json.loads(stdout_path.read_text())
    assert printed["value"] == "forked"
    assert printed["argv"][1:] == ["exit", "3"]
    assert printed["argv"][0].endswith("forked_echo.py")


def test_a_signal_ends_a_forked_service_in_its_own_session(
    server: ForkServer, tmp_path: Path
) -> None:
    log_path = tmp_path / "service.log"
    argv = [sys.executable, "-m", SERVICE, "wait"]
    child = ChildProcess("echo", argv, log_path, env_with_tests(), fork_server=server)
    try:
        assert child.is_forked
        child.wait_for_event("waiting", 30)
        assert os.getsid(child.pid) == child.pid  # NOTE: Ctrl-C reaches only the launcher
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "support-forked_"
        assert child.returncode is None
        assert child.wait(0.1) is None
        child.signal(signal.SIGTERM)
        assert child.wait(30) == -signal.SIGTERM
    finally:
        child.close()


def test_a_child_process_reads_the_events_a_forked_service_logs(
    server: ForkServer, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", SERVICE, "event"]
    child = ChildProcess(
        "echo", argv, tmp_path / "service.log", env_with_tests(), fork_server=server
    )
    try:
        record = child.wait_for_event("hello", 30)
        assert record["pid"] == child.pid
        assert child.wait(30) == 0
    finally:
        child.close()
    assert '"event": "hello"' in (tmp_path / "service.log").read_text()


def test_a_forked_service_shares_the_pages_of_what_the_server_imported(tmp_path: Path) -> None:
    with_torch = ForkServer(tmp_path / "fork-server.log", env_with_tests(), ("torch", "support"))
    try:
        argv = [sys.executable, "-m", SERVICE, "wait"]
        child = ChildProcess(
            "echo", argv, tmp_path / "s.log", env_with_tests(), fork_server=with_torch
        )
        try:
            record = child.wait_for_event("waiting", 30)
        finally:
            child.close()
    finally:
        with_torch.close()
    # NOTE: torch's import is about 150 MB of heap; the service maps the server's copy, so its
    # proportional share is at most about half of what it maps.
    shared_mb = (record["rss_kb"] - record["pss_kb"]) / 1024
    assert shared_mb > 50, record


def mapped_rss_kb(pid: int, path: Path) -> int:
    """The resident kB of `path`'s mappings in process `pid`."""
    total, is_it = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:
            is_it = len(fields) > 5 and fields[5] == str(path)
        elif is_it and fields[0] == "Rss:":
            total += int(fields[1])
    return total


async def test_once_settled_the_server_gives_back_the_file_pages_only_it_maps(
    tmp_path: Path,
) -> None:
    mapped = tmp_path / "mapped.bin"
    with mapped.open("wb") as file:
        file.write(os.urandom(8 << 20))
        file.flush()
        os.fsync(file.fileno())  # NOTE: clean pages: reclaimed without a write-back
    env = env_with_tests(PDSERVE_TEST_MAPPED_FILE=str(mapped))
    server = ForkServer(tmp_path / "fork-server.log", env, ("support.mapped_pages",))
    try:
        pid = server.process.pid
        assert mapped_rss_kb(pid, mapped) >= 8 << 10
        server.settle()
        await eventually(
            lambda: "fork_server_settled" in (tmp_path / "fork-server.log").read_text(),
            what="the server settled",
        )
        assert mapped_rss_kb(pid, mapped) < 1 << 10
        # NOTE: it still forks services.
        child = ChildProcess(
            "echo", [sys.executable, "-m", SERVICE, "wait"], tmp_path / "s.log", env,
            fork_server=server,
        )  # fmt: skip
        try:
            assert child.wait_for_event("waiting", 30)["rss_kb"] > 0
        finally:
            child.close()
    finally:
        server.close()


def test_a_server_whose_imports_fail_says_which(tmp_path: Path) -> None:
    with pytest.raises(ForkServerError, match="no_such_module_anywhere"):
        ForkServer(tmp_path / "fork-server.log", env_with_tests(), ("no_such_module_anywhere",))


def test_a_service_is_started_as_its_own_process_where_the_server_cannot_fork(
    server: ForkServer, tmp_path: Path
) -> None:
    server.close()
    argv = [sys.executable, "-m", SERVICE, "event"]
    child = ChildProcess(
        "echo", argv, tmp_path / "service.log", env_with_tests(), fork_server=server
    )
    try:
        assert not child.is_forked
        child.wait_for_event("hello", 60)
        assert child.wait(30) == 0
    finally:
        child.close()


def test_a_cluster_starts_its_services_itself_where_the_fork_server_does_not_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: object, **kwargs: object) -> ForkServer:
        raise ForkServerError("importing torch: refused")

    monkeypatch.setattr(cluster_module, "ForkServer", refused)
    cluster = Cluster(ClusterConfig(model="demo", log_dir=str(tmp_path)))
    cluster._start_fork_server()
    assert cluster.fork_server is None
    off = Cluster(ClusterConfig(model="demo", log_dir=str(tmp_path), fork_server=False))
    off._start_fork_server()
    assert off.fork_server is None


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # NOTE: exited meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("is_reply_first", [False, True], ids=["reply_after", "reply_before"])
async def test_a_service_forked_after_its_caller_gave_up_is_stopped(
    server: ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, is_reply_first: bool
) -> None:
    """The caller gives up before the fork server's reply comes, or (a busy machine's order)
    after the reply was read but before the caller marked its request abandoned: either way
    the late service is stopped, not left to the next spawn."""

    def gives_up(timeout: float | None = None) -> dict[str, object]:
        deadline = time.monotonic() + 30
        while is_reply_first and not server._replies.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise queue.Empty  # NOTE: as a wait of SPAWN_TIMEOUT_S that ran out, whatever the clock

    with monkeypatch.context() as patched:
        patched.setattr(server._replies, "get", gives_up)
        with (tmp_path / "out.log").open("w") as out, pytest.raises(ForkServerError):
            server.spawn(SERVICE, ["wait"], env_with_tests(), out.fileno(), out.fileno())
    await eventually(lambda: bool(server.stopped_late), 30, "the late service's pid to come")
    (late,) = server.stopped_late
    await eventually(lambda: late not in children_of(server.process.pid), 30, "it to be gone")
    with (tmp_path / "out.log").open("w") as out:
        process = server.spawn(SERVICE, ["exit", "0"], env_with_tests(), out.fileno(), out.fileno())
    assert process.wait(30) == 0
