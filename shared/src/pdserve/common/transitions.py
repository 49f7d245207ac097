"""A request's life cycle as a table of the moves it allows, and the one error for any other.

Each service keeps its own status enum and its own table (`transition_table` builds it: the
moves of each open state, the endings every open state may take, no way out of a terminal
state); a request checks a move against its table with `check_transition` before it makes it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import TypeVar

StatusT = TypeVar("StatusT", bound=enum.Enum)


class IllegalTransition(AssertionError):
    """A transition the state machine does not allow (a bug, never a client error)."""

    def __init__(self, current: enum.Enum, new: enum.Enum) -> None:
        super().__init__(f"{current.name} -> {new.name}")
        self.current = current
        self.new = new


def transition_table(
    moves: Mapping[StatusT, Iterable[StatusT]],
    endings: Iterable[StatusT],
    terminal: Iterable[StatusT],
) -> dict[StatusT, frozenset[StatusT]]:
    """The whole table: each open state in `moves` may go where it lists or to any of
    `endings`; a `terminal` state goes nowhere."""
    ending_set = frozenset(endings)
    return {
        **{status: ending_set | frozenset(nexts) for status, nexts in moves.items()},
        **{status: frozenset() for status in terminal},
    }


def check_transition(
    table: Mapping[StatusT, frozenset[StatusT]], current: StatusT, new: StatusT
) -> None:
    """Raises IllegalTransition unless `table` lets `new` follow `current`."""
    if new not in table[current]:
        raise IllegalTransition(current, new)
