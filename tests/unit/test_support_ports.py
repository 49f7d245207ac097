"""`support.ports.free_port`: the ports the test clusters' gateways bind again when restarted."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Sequence

import pytest
from support import ports


def test_a_run_of_ports_lies_below_the_ephemeral_range_and_is_free() -> None:
    first = ports.free_port(count=6)
    assert first >= ports.LOWEST and first + 6 <= ports._ephemeral_low()
    for port in range(first, first + 6):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


def test_a_run_with_one_port_taken_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: the five ports come from below the ephemeral range, where no connection of a test
    # running beside this one can take the run's last three between the two draws.
    first = ports.free_port(count=5)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first + 1))
        # NOTE: the first draw's run of three holds the taken port in its middle.
        draws = iter([first, first + 2])

        def choice(candidates: Sequence[int]) -> int:
            return next(draws)

        monkeypatch.setattr(ports.random, "choice", choice)
        monkeypatch.setattr(ports, "_handed_out", set())  # NOTE: the five were handed out above
        assert ports.free_port(count=3) == first + 2


def test_a_run_handed_out_once_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: the second draw falls inside the first run, still free (no server bound it yet).
    first = ports.free_port(count=3)
    draws = iter([first + 2, first - 1, first + 3])

    def choice(candidates: Sequence[int]) -> int:
        return next(draws)

    monkeypatch.setattr(ports.random, "choice", choice)
    assert ports.free_port(count=2) == first + 3


@pytest.mark.parametrize("count", [2, 3, 8])
def test_each_xdist_worker_draws_from_a_slice_of_its_own(
    monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    whole = range(ports.LOWEST, ports._ephemeral_low())
    slices = []
    for index in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
        slices.append(ports._worker_slice(whole))
        first = ports.free_port(count=4)
        assert slices[-1].start <= first and first + 4 <= slices[-1].stop
    for before, after in itertools.pairwise(slices):
        assert before.stop <= after.start
    assert sum(len(part) for part in slices) > len(whole) - count
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert ports._worker_slice(whole) == whole
