"""The requests a decode keeps for their streams: until the stream ends, or, for a resumable
request (contract 1.9), while it runs on detached and for a while after its end.

`KeptRequests` decides what happens to a request when its Generate stream ends (release it,
forget it, keep it, or detach it for a resume) and, on each sweep, releases the detached ones
nobody resumed and forgets the ended ones nobody will read.
"""

from __future__ import annotations

import time

import structlog

from pdserve.decode.decode_loop import DecodeLoop
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.request import DecodeRequest

log = structlog.get_logger(__name__)


class KeptRequests:
    """The decode's requests by lease id, with the rules for keeping them.

    Args:
        loop: The decode thread (it releases requests).
        detached_keep_s: How long a resumable request is kept without a stream: detached
            (then released) or after its end (then forgotten).
        max_detached_requests: Most detached requests kept; a resumable stream that breaks
            beyond them releases its request at once.
    """

    def __init__(
        self, loop: DecodeLoop, detached_keep_s: float = 60.0, max_detached_requests: int = 256
    ) -> None:
        self.loop = loop
        self.detached_keep_s = detached_keep_s
        self.max_detached_requests = max_detached_requests
        # NOTE: by lease id, until their stream ends (a resumable one's: until it is released
        # or forgotten after the keep time).
        self.requests: dict[str, DecodeRequest] = {}

    @property
    def num_detached(self) -> int:
        """Requests running on with no stream attached, waiting for a resume."""
        return sum(
            1
            for lease in list(self.requests.values())
            if lease.is_detached and not lease.status.is_terminal
        )

    def stream_ended(self, lease: DecodeRequest, epoch: int, is_done: bool) -> None:
        """After a stream attached with `epoch` ended (`is_done`: with its terminal event or
        an error ending): releases or forgets the request, keeps it, or detaches it."""
        if not lease.events.is_current(epoch):
            return  # NOTE: a resume took it over; that stream owns it now.
        if not lease.is_resumable:
            if not is_done:
                # NOTE: the client went away: release the lease (decode thread ends it).
                self.loop.release(lease, RequestStatus.ABORTED)
            self.requests.pop(lease.lease_id, None)
            return
        if is_done or lease.status.is_terminal:
            lease.is_attached = False  # kept for the keep time after its end, for a resume
            return
        fields = {
            "request_id": lease.request_id,
            "lease_id": lease.lease_id,
            "num_generated_tokens": max(0, lease.num_generated_tokens),
        }
        if self.num_detached >= self.max_detached_requests:
            log.warning("detached_limit_reached", limit=self.max_detached_requests, **fields)
            self.loop.release(lease, RequestStatus.ABORTED)
            self.requests.pop(lease.lease_id, None)
            return
        lease.detach()
        log.info("generate_detached", **fields)

    def sweep(self, ttl_s: float) -> None:
        """Forgets ended requests nobody attached to (after `ttl_s`); releases detached
        requests nobody resumed within the keep time and forgets resumable ones that ended
        longer ago."""
        now = time.monotonic()
        forget_before = now - ttl_s
        keep_before = now - self.detached_keep_s
        for lease_id, lease in list(self.requests.items()):
            if lease.is_attached:
                continue
            if lease.is_resumable:
                if lease.ended_at is not None:
                    if lease.ended_at < keep_before:
                        del self.requests[lease_id]  # its tail was there to replay; no more
                elif lease.detached_at is not None and lease.detached_at < keep_before:
                    self._release_detached(lease)
                continue
            if lease.ended_at is not None and lease.ended_at < forget_before:
                del self.requests[lease_id]  # ended and never attached: nobody will read it

    def _release_detached(self, lease: DecodeRequest) -> None:
        log.info(
            "detached_request_released",
            request_id=lease.request_id,
            lease_id=lease.lease_id,
            num_generated_tokens=max(0, lease.num_generated_tokens),
        )
        self.loop.release(lease, RequestStatus.ABORTED, "detached past the keep time")
        del self.requests[lease.lease_id]
