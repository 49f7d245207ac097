"""The NIXL channel's pipelined send: groups written on one worker thread and checksummed on
another, each announced once it landed, in order; a failed WRITE stops the writes after it, and
a cancelled send returns only once no WRITE is under way. The window is a stand-in here (no
NIXL needed); `tests/integration/prefill/test_kv_nixl.py` runs the real one."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transfer import KvPiece, chunk_crc32c, sequence_pieces
from pdserve.kv.transports.nixl import NixlUnavailable
from pdserve.prefill.kv.nixl import NixlChannel
from pdserve.v1 import decode_pb2

LAYOUT = KVCacheLayout(num_layers=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
# K+V bytes of a piece: 2 blocks (4 layers of 8 blocks: 16 pieces)
PIECE = 2 * 2 * LAYOUT.block_nbytes


class _Window:
    """Takes pieces and "lands" them in `wait`, after `delay_s`; the `fail_at`-th wait fails."""

    def __init__(self, fail_at: int | None = None, delay_s: float = 0.0) -> None:
        self.fail_at = fail_at
        self.delay_s = delay_s
        self.pending: list[tuple[KvPiece, bool]] = []
        self.landed: list[list[tuple[KvPiece, bool]]] = []
        self.num_waits = 0
        self.in_wait = threading.Event()

    def take(self, piece: KvPiece, *, corrupt: bool = False) -> None:
        self.pending.append((piece, corrupt))

    def wait(self) -> None:
        self.in_wait.set()
        try:
            time.sleep(self.delay_s)
            self.num_waits += 1
            if self.num_waits - 1 == self.fail_at:
                raise NixlUnavailable("the decode is gone")
            self.landed.append(self.pending)
            self.pending = []
        finally:
            self.in_wait.clear()


def _channel(window: _Window) -> tuple[NixlChannel, list[tuple[int, int, int, int]]]:
    """A channel on `window` whose announcements are recorded as (layer, first block, CRC,
    groups landed when announced)."""
    channel = NixlChannel(stub=Any, request=Any, side=Any, target=Any)  # type: ignore[arg-type]
    channel._window = window  # type: ignore[assignment]
    announced: list[tuple[int, int, int, int]] = []

    async def write(message: decode_pb2.SyncCacheRequest) -> None:
        chunk = message.chunk
        announced.append((chunk.layer_index, chunk.first_block, chunk.crc32c, len(window.landed)))
        await asyncio.sleep(0)

    channel._write = write  # type: ignore[method-assign]
    return channel, announced


def _pieces() -> list[KvPiece]:
    cache = KVCache(LAYOUT, 8, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape))
    return list(sequence_pieces(cache, list(range(8)), PIECE))


async def test_every_group_is_announced_in_order_once_it_landed_with_the_senders_checksums() -> (
    None
):
    window = _Window()
    channel, announced = _channel(window)
    channel.group_bytes = 3 * PIECE  # NOTE: groups of 3 pieces: 6 groups, the last one short
    pieces = _pieces()
    await channel._send_pipelined(pieces, corrupt_first=True)
    assert [(a[0], a[1], a[2]) for a in announced] == [
        (p.layer_index, p.first_block, chunk_crc32c(p.key, p.value)) for p in pieces
    ]
    assert all(num_landed > i // 3 for i, (*_, num_landed) in enumerate(announced))
    assert [len(group) for group in window.landed] == [3, 3, 3, 3, 3, 1]
    corrupted = [i for group in window.landed for i, (_, corrupt) in enumerate(group) if corrupt]
    assert corrupted == [0] and window.landed[0][0][1]


async def test_a_failed_write_stops_the_writes_after_it_and_announces_nothing_more() -> None:
    window = _Window(fail_at=1)
    channel, announced = _channel(window)
    channel.group_bytes = 4 * PIECE
    with pytest.raises(NixlUnavailable, match="gone"):
        await channel._send_pipelined(_pieces(), corrupt_first=False)
    assert window.num_waits == 2  # NOTE: the failed group's, nothing posted after it
    assert len(announced) == 4 and {a[3] for a in announced} == {1}


async def test_a_cancelled_send_returns_once_no_write_is_under_way() -> None:
    window = _Window(delay_s=0.05)
    channel, announced = _channel(window)
    channel.group_bytes = 2 * PIECE
    send = asyncio.ensure_future(channel._send_pipelined(_pieces(), corrupt_first=False))
    while not announced:
        await asyncio.sleep(0.005)
    send.cancel()
    with pytest.raises(asyncio.CancelledError):
        await send
    assert not window.in_wait.is_set()
    num_waits = window.num_waits
    await asyncio.sleep(0.15)
    assert window.num_waits == num_waits < 8  # NOTE: stopped after the group under way
