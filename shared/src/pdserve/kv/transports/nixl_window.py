"""One lease's writer over NIXL: the lease's pieces written from the sender's own registered
cache into exactly the lease's blocks of the decode's, with one-sided WRITEs
(`pdserve.kv.transports.nixl` has the agents and the decode's targets).

Like the shared-memory `pdserve.kv.transports.shm.LeaseWindow`, a `NixlWindow` addresses a piece by
its logical blocks within the lease: a write outside the leased blocks (or into the ones the lease
shares with another) cannot be expressed, and the sender's agent refuses an address outside the
decode's registered cache. The decode still verifies every chunk's CRC-32C in its own cache before
it commits."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import structlog

from pdserve.kv.transfer import KvPiece, chunk_crc32c, writable_range
from pdserve.kv.transports.nixl import NixlPeers, NixlTarget, NixlUnavailable

log = structlog.get_logger(__name__)

# Polling a WRITE under way: without a pause (only yielding) for its first milliseconds, in
# which a group of a few MiB completes, then with pauses doubling up to a millisecond.
_BUSY_POLL_S = 0.005
_MAX_POLL_S = 0.001
# How long a posted WRITE may take before the window gives up on the decode (a partition or a
# hung peer: over TCP a WRITE then never completes) and drops its agent.
WRITE_TIMEOUT_S = 30.0


class NixlWindow:
    """Writes one lease's KV into its blocks of a decode's registered cache, and nowhere else.

    `write` takes one piece's blocks and returns its CRC-32C (`take` the same without the
    checksum, for a sender that checksums on another thread); `post` posts the WRITEs of every
    piece taken since as one transfer (runs contiguous on both sides merged into one
    descriptor); `wait` posts and returns once every posted WRITE completed: then they are in
    the decode's memory. One thread at a time uses a window.

    Args:
        peers: The sender's agent and the decode agents it loaded (this one's is loaded now).
        target: The lease's blocks on the decode.
        num_shared_blocks: Leading blocks the lease shares with another lease: never written.
        timeout_s: How long `wait` waits for posted WRITEs before it gives up.
    """

    def __init__(
        self,
        peers: NixlPeers,
        target: NixlTarget,
        num_shared_blocks: int = 0,
        timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        peers.load(target)
        self.peers = peers
        self.timeout_s = timeout_s
        self.local = peers.local
        self.target = target
        self.num_shared_blocks = num_shared_blocks
        # (address, length, device) rows here and on the decode, of the WRITEs to post
        self._local: list[list[int]] = []
        self._remote: list[list[int]] = []
        # (decode address, byte) of the bytes to flip once the WRITEs landed (fault injection)
        self._flips: list[tuple[int, int]] = []
        self._posted: list[Any] = []

    def write(self, piece: KvPiece, *, corrupt: bool = False) -> int:
        """Takes the WRITEs of `piece` into the lease's blocks (from the sender's own cache,
        its ``source_block_ids``; `wait` posts them); returns the CRC-32C of the piece.

        `corrupt` flips one written byte after the checksum (fault injection).

        Raises:
            IndexError: The piece's logical blocks are not all within the lease's writable
                blocks.
            ValueError: The piece was not cut from the sender's cache.
        """
        self.take(piece, corrupt=corrupt)
        return chunk_crc32c(piece.key, piece.value)

    def take(self, piece: KvPiece, *, corrupt: bool = False) -> None:
        """Takes the WRITEs of `piece` as `write` does, without its CRC-32C (a sender that
        checksums the piece on another thread while the WRITEs go).

        Raises:
            IndexError: As `write`.
            ValueError: As `write`.
        """
        num_unwritable = self.num_shared_blocks
        if piece.layer_index in self.target.window_layers:
            # NOTE: a window layer's blocks a window behind have no storage on the decode.
            num_unwritable = max(num_unwritable, self.target.num_window_skipped)
        writable_range(piece, len(self.target.block_addresses), num_unwritable)
        if len(piece.source_block_ids) != piece.num_blocks:
            raise ValueError("a NIXL write reads the sender's cache: the piece has no blocks there")
        self._add_descriptors(piece)
        if corrupt:
            first = np.frombuffer(piece.key, dtype=np.uint8, count=1)[0]
            address = self.target.address(piece.layer_index, 0, piece.first_block)
            self._flips.append((address, int(first) ^ 0xFF))

    def post(self) -> None:
        """Posts the WRITEs taken so far as one transfer, without waiting for it.

        Raises:
            NixlUnavailable: The transfer cannot be posted.
        """
        if not self._local:
            return
        local = np.array(self._local, dtype=np.uint64)
        remote = np.array(self._remote, dtype=np.uint64)
        self._local.clear()
        self._remote.clear()
        try:
            self._post(local, remote, self.local.memory_kind)
        except NixlUnavailable:
            self._abandon()
            raise

    def wait(self) -> None:
        """Posts the WRITEs taken so far and returns once every posted WRITE completed.

        Raises:
            NixlUnavailable: A WRITE failed (the decode's process or connection is gone), or
                did not complete within the window's timeout.
        """
        self.post()
        try:
            self._poll()
            for address, value in self._flips:
                # NOTE: after the piece's own WRITE landed, so that it is not overwritten.
                self.local.scratch[0] = value
                self._post(
                    np.array([[self.local.scratch.ctypes.data, 1, 0]], dtype=np.uint64),
                    np.array([[address, 1, self.target.device_id]], dtype=np.uint64),
                    "DRAM",
                )
                self._poll()
            self._flips.clear()
        except NixlUnavailable:
            self._abandon()
            raise

    def _add_descriptors(self, piece: KvPiece) -> None:
        """Adds the rows of the piece's K then V blocks, here and on the decode; a block that
        continues the last row on both sides extends it."""
        nbytes = self.target.block_nbytes
        local, remote = self._local, self._remote
        for kv_index in (0, 1):
            for offset, source_id in enumerate(piece.source_block_ids):
                src = self.local.block_address(piece.layer_index, kv_index, source_id)
                dst = self.target.address(piece.layer_index, kv_index, piece.first_block + offset)
                if (
                    local
                    and local[-1][0] + local[-1][1] == src
                    and (remote[-1][0] + remote[-1][1] == dst)
                ):
                    local[-1][1] += nbytes
                    remote[-1][1] += nbytes
                    continue
                local.append([src, nbytes, self.local.device_id])
                remote.append([dst, nbytes, self.target.device_id])

    def _post(self, local: np.ndarray, remote: np.ndarray, local_kind: str) -> None:
        agent = self.local.agent
        try:
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(local, local_kind),
                agent.get_xfer_descs(remote, self.target.memory_kind),
                self.target.agent_name,
            )
        except Exception as error:  # NOTE: NIXL raises its own exception types
            raise NixlUnavailable(f"a WRITE to {self.target.agent_name}: {error}") from None
        self._posted.append(handle)
        if agent.transfer(handle) == "ERR":
            raise NixlUnavailable(f"a WRITE to agent {self.target.agent_name} failed")

    def _poll(self) -> None:
        """Returns once every posted WRITE completed (polled, pausing up to a millisecond).

        Raises:
            NixlUnavailable: A WRITE failed, or is not done after `timeout_s`.
        """
        agent = self.local.agent
        pause = 0.0
        now = time.monotonic()
        busy_until = now + _BUSY_POLL_S
        deadline = now + self.timeout_s
        while self._posted:
            state = agent.check_xfer_state(self._posted[0])
            if state == "DONE":
                agent.release_xfer_handle(self._posted.pop(0))
                pause = 0.0
            elif state == "PROC":
                if time.monotonic() > deadline:
                    raise NixlUnavailable(
                        f"a WRITE to agent {self.target.agent_name} not done after "
                        f"{self.timeout_s:.0f} s"
                    )
                time.sleep(pause)
                if time.monotonic() > busy_until:
                    pause = min(_MAX_POLL_S, 2 * pause or 1e-5)
            else:
                raise NixlUnavailable(f"a WRITE to agent {self.target.agent_name} failed")

    def _abandon(self) -> None:
        """After a failed WRITE: releases what is posted and drops the decode's agent."""
        for handle in self._posted:
            try:
                self.local.agent.release_xfer_handle(handle)
            except Exception as error:  # NOTE: a handle still under way cannot be released
                log.info("nixl_release_failed", detail=str(error))
        self._posted.clear()
        self._local.clear()
        self._remote.clear()
        self._flips.clear()
        self.peers.forget(self.target.agent_name)
