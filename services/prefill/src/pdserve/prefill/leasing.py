"""A request's decode lease, as its handoff task gets it: asked for, checked, never leaked.

`open_lease` asks the target decode for blocks (`DecodePeers.allocate`) in a
``prefill.allocate`` span, records the grant on the request (so the request's cleanup
releases it, `release_lease`), and refuses a grant from a decode other than the one the
gateway named. A grant that arrives after the request was aborted is released at once instead
of being left to the lease TTL.
"""

from __future__ import annotations

import asyncio
import functools
import time

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
