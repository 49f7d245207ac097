"""Where a client stands in a request's output: one numbering for every front end.

A position is a number of completion tokens: the point after the first N tokens of a choice.
A delta covers the tokens ``first_index`` to ``first_index + len(token_ids)``; one with no
tokens (the final delta, or a step of text or calls alone) sits at ``first_index``. A client
that resumes says the position it has reached: a REST stream's ``starting_after`` (or
``Last-Event-ID``: each event's ``id`` is the position after it) and a gRPC ``from_index``
both are one.

The Responses API numbers its events by sequence number instead; its writer makes them from
a session's deltas from the start (every event is a function of the tokens), and only that
step, numbering the events, stays in its front end.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import NamedTuple

from pdserve.gateway.request import OutputDelta


def is_after(delta: OutputDelta, after: int | None) -> bool:
    """Whether a client at position `after` (None: it has nothing) still needs `delta`.

    A delta holding tokens is needed when it holds one past `after`. A delta without tokens
    is needed when it comes after the client's last token: past `after`, or at it when the
    client has a token (at position 0 the client has seen the events before the first token).
    The final delta is always needed: past the end, the end.
    """
    if after is None or delta.finish_reason is not None:
        return True
    if delta.token_ids:
        return delta.first_index + len(delta.token_ids) > after
    return delta.first_index > after or (delta.first_index == after and after > 0)


class Step(NamedTuple):
    """One delta of a session, marked for a client at some position.

    Attributes:
        choice_index: The choice it belongs to.
        delta: The delta.
        is_after: The client still needs it (`is_after`).
    """

    choice_index: int
    delta: OutputDelta
    is_after: bool

    @property
    def position(self) -> int:
        """The position once this delta is sent: its choice's tokens up to its last."""
        return self.delta.first_index + len(self.delta.token_ids)


async def steps_after(
    deltas: AsyncGenerator[tuple[int, OutputDelta], None], after: int | None
) -> AsyncGenerator[Step, None]:
    """Every delta of `deltas`, each marked whether a client at `after` needs it.

    Every delta is given, not only the needed ones: a writer that keeps state across deltas
    (a completion's text offsets, its running usage, its first chunk's role) has to see them
    all to shape the later ones as the first stream did.
    """
    try:
        async for index, delta in deltas:
            yield Step(index, delta, is_after(delta, after))
    finally:
        await deltas.aclose()


async def deltas_after(
    deltas: AsyncGenerator[tuple[int, OutputDelta], None], after: int | None
) -> AsyncGenerator[tuple[int, OutputDelta], None]:
    """The deltas of `deltas` that a client at `after` still needs."""
    steps = steps_after(deltas, after)
    try:
        async for step in steps:
            if step.is_after:
                yield step.choice_index, step.delta
    finally:
        await steps.aclose()
