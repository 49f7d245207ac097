"""The lease states of a decode request and the moves between them.

A request's status walks ALLOCATED -> SYNCING -> COMMITTED -> RUNNING -> FINISHED or PREEMPTED,
or ends ABORTED, EXPIRED or FAILED from any open state; `TRANSITIONS` is the whole state machine
(`DecodeRequest.move_to`/`end` check it). The events a request's Generate stream reads name
how it ended with these states too.
"""

from __future__ import annotations

import enum

from pdserve.common.transitions import transition_table


class RequestStatus(enum.IntEnum):
    """Life cycle of a decode request (the lease states); values from FINISHED on are terminal."""

    ALLOCATED = 1
    SYNCING = 2
    COMMITTED = 3
    RUNNING = 4
    FINISHED = 5
    PREEMPTED = 6
    ABORTED = 7
    EXPIRED = 8
    FAILED = 9

    @property
    def is_terminal(self) -> bool:
        return self >= RequestStatus.FINISHED


_S = RequestStatus
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = transition_table(
    {
        _S.ALLOCATED: {_S.SYNCING},
        _S.SYNCING: {_S.COMMITTED},
        _S.COMMITTED: {_S.RUNNING},
        _S.RUNNING: {_S.FINISHED, _S.PREEMPTED},
    },
    endings={_S.ABORTED, _S.EXPIRED, _S.FAILED},  # possible in every open state
    terminal=(status for status in RequestStatus if status.is_terminal),
)
