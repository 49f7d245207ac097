"""`support.ports.free_port`: the ports the test clusters' gateways bind again when restarted."""

from __future__ import annotations

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
        assert ports.free_port(count=3) == first + 2
