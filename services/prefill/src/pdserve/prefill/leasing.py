"""A request's decode lease, as its handoff task gets it: taken at its turn, asked for,
checked, never leaked.

A lease's TTL runs from its grant, and a prefill computes one prompt after another: a request
that took its lease on arrival behind many prompts would see it expire before its own turn.
`LeaseWindow` lets requests take their leases (and reach the engine) in arrival order only
while the prompts ahead of them, inside and not yet computed, hold fewer tokens than its bound;
the others wait here, holding nothing of a decode's. `open_lease` asks the target decode for
blocks (`DecodePeers.allocate`) in a ``prefill.allocate`` span, records the grant on the
request (so the request's cleanup releases it, `release_lease`), and refuses a grant from a
decode other than the one the gateway named. A grant that arrives after the request was
aborted is released at once instead of being left to the lease TTL.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import structlog

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.prefill.decode_client import DecodePeers
from pdserve.prefill.events import LeaseGrant
from pdserve.prefill.request import Request

log = structlog.get_logger(__name__)
_tracer = telemetry.tracer("pdserve.prefill")


async def open_lease(
    peers: DecodePeers, request: Request, background: set[asyncio.Future[bool]]
) -> LeaseGrant:
    """Gets `request` a lease on its decode and opens it on the request (``lease``,
    ``is_lease_open``).

    Args:
        peers: Channels to the decodes.
        request: A request in PREPARING.
        background: Holds the release of a grant that arrives after cancellation.

    Raises:
        PdserveError: The allocation's error; PERMISSION_DENIED when the decode that granted
            the lease is not the instance the gateway named (the lease stays open, for the
            request's cleanup to release).
    """
    with _tracer.start_as_current_span(
        "prefill.allocate",
        attributes={
            telemetry.REQUEST_ID: request.request_id,
            "pdserve.decode.address": request.decode_address,
        },
    ) as allocate_span:
        allocation = asyncio.ensure_future(peers.allocate(request))
        try:
            lease = await asyncio.shield(allocation)
        except asyncio.CancelledError:
            # NOTE: the decode may still grant the lease after this request was
            # aborted: release it then instead of leaving it to the lease TTL.
            allocation.add_done_callback(
                functools.partial(_release_late_grant, peers, request, background)
            )
            raise
        allocate_span.set_attribute("pdserve.lease_id", lease.lease_id)
        allocate_span.set_attribute("pdserve.num_blocks", len(lease.block_ids))
    request.lease = lease
    request.is_lease_open = True
    request.phases.lease_granted = time.monotonic()
    log.info(
        "lease_granted",
        request_id=request.request_id,
        lease_id=lease.lease_id,
        decode_instance_id=lease.decode_instance_id,
    )
    if request.decode_instance_id not in ("", lease.decode_instance_id):
        # NOTE: whoever answers at that address is not the decode the gateway chose:
        # no KV goes to it (the open lease is released by the cleanup).
        raise PdserveError(
            ErrorReason.PERMISSION_DENIED,
            f"the decode at {request.decode_address} is {lease.decode_instance_id!r}, "
            f"not {request.decode_instance_id!r} as the gateway named",
            {"requestId": request.request_id, "decodeAddress": request.decode_address},
        )
    return lease


async def release_lease(peers: DecodePeers, request: Request) -> None:
    """Releases `request`'s decode lease unless it was handed off or released already."""
    if not request.is_lease_open or request.lease is None:
        return
    request.is_lease_open = False
    await peers.release_lease(request.decode_address, request.lease, request.request_id)


def _release_late_grant(
    peers: DecodePeers,
    request: Request,
    background: set[asyncio.Future[bool]],
    allocation: asyncio.Future[LeaseGrant],
) -> None:
    if allocation.cancelled() or allocation.exception() is not None:
        return
    lease = allocation.result()
    log.info("late_lease_released", request_id=request.request_id, lease_id=lease.lease_id)
    release = asyncio.ensure_future(
        peers.release_lease(request.decode_address, lease, request.request_id)
    )
    background.add(release)
    release.add_done_callback(background.discard)


@dataclass(eq=False)
class WindowPlace:
    """A request's place in a `LeaseWindow`: its decode, its estimated tokens to compute, and
    where it stands (in line, asking for its lease, leased, or out)."""

    window: LeaseWindow
    decode: str
    num_tokens: int
    order: int
    admitted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    is_asking: bool = False
    is_leased: bool = False
    has_waited: bool = False

    def leased(self) -> None:
        """Its lease is granted (or it needs none): it now waits for the engine."""
        self.window.on_leased(self)

    def leave(self) -> None:
        """Gives the place back (its prompt is computed, or the request ended); idempotent."""
        self.window.leave(self)


class LeaseWindow:
    """Which requests may take their decode lease now: in arrival order, while the tokens
    still to compute of the leased requests, and of those asking the same decode, stay within
    `max_tokens`.

    A request let in asks its decode for a lease, then sits in the engine's queue; it leaves
    once its prompt is computed (its first token) or it ends. Requests behind wait in line
    without a lease, so a decode's lease TTL covers only the prompts about to be computed, and a
    decode's blocks are not held for prompts far from their turn. A request still asking counts
    only against later requests for the same decode (a slow or full decode delays only its own
    requests); a request that does not fit beside the leased ones holds back every later one,
    so a long prompt is never starved by short ones. A request whose decode has nothing asking
    and nothing leased here always gets in, whatever its size.

    Args:
        max_tokens: The bound; None lets every request in at once (leases on arrival).
    """

    def __init__(self, max_tokens: int | None) -> None:
        self.max_tokens = max_tokens
        self.num_tokens = 0  # estimated tokens to compute of the leased requests
        self.num_waited = 0  # requests that had to wait in line, since start
        self._asking: Counter[str] = Counter()  # tokens of the requests asking each decode
        self._lines: dict[str, deque[WindowPlace]] = {}
        self._next_order = 0

    @property
    def num_waiting(self) -> int:
        """Requests in line for the window."""
        return sum(len(line) for line in self._lines.values())

    async def enter(self, num_tokens: int, decode: str) -> WindowPlace:
        """Waits for a place for a request to `decode` ("": one that takes no lease) with
        `num_tokens` to compute. The caller calls `WindowPlace.leased` once its lease is
        granted and `WindowPlace.leave` when its prompt is computed or it ends. Cancelled in
        line, it takes no place.
        """
        place = WindowPlace(self, decode, num_tokens, self._next_order)
        self._next_order += 1
        self._lines.setdefault(decode, deque()).append(place)
        self._admit_next()
        if place.admitted.done():
            return place
        place.has_waited = True
        self.num_waited += 1
        try:
            await place.admitted
        except asyncio.CancelledError:
            line = self._lines.get(decode)
            if line is not None and place in line:
                line.remove(place)
            place.leave()  # NOTE: let in just as it was cancelled: give the place back.
            self._admit_next()
            raise
        return place

    def on_leased(self, place: WindowPlace) -> None:
        """`place` holds its lease: its tokens count against every request from now on."""
        if not place.is_asking:
            return
        place.is_asking, place.is_leased = False, True
        self._asking[place.decode] -= place.num_tokens
        self.num_tokens += place.num_tokens
        self._admit_next()

    def leave(self, place: WindowPlace) -> None:
        """Frees `place` (idempotent) and lets the next requests in line in."""
        if place.is_asking:
            self._asking[place.decode] -= place.num_tokens
        elif place.is_leased:
            self.num_tokens -= place.num_tokens
        else:
            return
        place.is_asking = place.is_leased = False
        self._admit_next()

    def _fits(self, place: WindowPlace) -> bool:
        ahead = self.num_tokens + self._asking[place.decode]
        return self.max_tokens is None or ahead == 0 or ahead + place.num_tokens <= self.max_tokens

    def _is_short_of_leased_room(self, place: WindowPlace) -> bool:
        """Whether `place` would not fit even with nothing asking its decode."""
        assert self.max_tokens is not None
        return self.num_tokens > 0 and self.num_tokens + place.num_tokens > self.max_tokens

    def _admit_next(self) -> None:
        """Lets in the heads of the lines, earliest first, that fit; stops at the first that
        the leased requests leave no room for (the later ones wait behind it)."""
        held_lines: set[str] = set()
        while True:
            heads = []
            for decode, line in list(self._lines.items()):
                while line and line[0].admitted.done():
                    line.popleft()  # NOTE: cancelled in line; its task has not run yet.
                if not line:
                    del self._lines[decode]
                elif decode not in held_lines:
                    heads.append(line[0])
            if not heads:
                return
            place = min(heads, key=lambda head: head.order)
            if not self._fits(place):
                if self._is_short_of_leased_room(place):
                    return
                held_lines.add(place.decode)  # NOTE: its own decode's askers hold it back.
                continue
            self._lines[place.decode].popleft()
            place.is_asking = True
            self._asking[place.decode] += place.num_tokens
            place.admitted.set_result(None)
