"""The NIXL channel's pipelined send: groups written on one worker thread and checksummed on
another, each announced once it landed, in order (a chunk per run of a layer's blocks in it); a
failed WRITE stops the writes after it, and a cancelled send returns only once no WRITE is under
way. The window is a stand-in here (no NIXL needed); `tests/integration/prefill/test_kv_nixl.py`
runs the real one."""

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
    """Takes pieces and "lands" them in `wait` (into `landed`), after `delay_s`; the
    `fail_at`-th wait fails."""

    def __init__(
        self,
        landed: list[list[tuple[KvPiece, bool]]],
        fail_at: int | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.fail_at = fail_at
        self.delay_s = delay_s
        self.pending: list[tuple[KvPiece, bool]] = []
        self.landed = landed
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


def _channel(window: _Window) -> tuple[NixlChannel, list[tuple[int, int, int, int, int]]]:
    """A channel on `window` whose announcements are recorded as (layer, first block, number
    of blocks, CRC, groups landed when announced)."""
    channel = NixlChannel(stub=Any, request=Any, side=Any, target=Any)  # type: ignore[arg-type]
    channel._window = window  # type: ignore[assignment]
    landed = window.landed
    announced: list[tuple[int, int, int, int, int]] = []

    async def write(message: decode_pb2.SyncCacheRequest) -> None:
        chunk = message.chunk
        announced.append(
            (chunk.layer_index, chunk.first_block, chunk.num_blocks, chunk.crc32c, len(landed))
        )
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
    landed: list[list[tuple[KvPiece, bool]]] = []
    channel, announced = _channel(_Window(landed))
    channel.group_bytes = 3 * PIECE  # NOTE: groups of 3 pieces: 6 groups, the last one short
    pieces = _pieces()
    num_chunks = await channel._send_pipelined(pieces, corrupt_first=True)
    # NOTE: 4 pieces per layer in groups of 3: each group's pieces of one layer are one chunk,
    # whose checksum is that of all their K, then all their V.
    expected = []
    groups = [pieces[start : start + 3] for start in range(0, len(pieces), 3)]
    for group in groups:
        for layer in sorted({p.layer_index for p in group}):
            run = [p for p in group if p.layer_index == layer]
            key = b"".join(bytes(p.key) for p in run)
            value = b"".join(bytes(p.value) for p in run)
            first, num_blocks = run[0].first_block, sum(p.num_blocks for p in run)
            expected.append((layer, first, num_blocks, chunk_crc32c(key, value), group))
    assert [a[:4] for a in announced] == [e[:4] for e in expected]
    assert num_chunks == len(announced) == 8
    for (*_, num_landed), (*_, group) in zip(announced, expected, strict=True):
        assert group in [[p for p, _ in got] for got in landed[:num_landed]], "not landed yet"
    assert [len(group) for group in landed] == [3, 3, 3, 3, 3, 1]
    corrupted = [p for group in landed for p, corrupt in group if corrupt]
    assert corrupted == [pieces[0]]


async def test_a_failed_write_stops_the_writes_after_it_and_announces_nothing_more() -> None:
    window = _Window([], fail_at=1)
    channel, announced = _channel(window)
    channel.group_bytes = 4 * PIECE
    with pytest.raises(NixlUnavailable, match="gone"):
        await channel._send_pipelined(_pieces(), corrupt_first=False)
    assert window.num_waits == 2  # NOTE: the failed group's, nothing posted after it
    # NOTE: the first group, layer 0's 4 pieces, is one chunk
    assert len(announced) == 1 and {a[4] for a in announced} == {1}


async def test_a_cancelled_send_returns_once_no_write_is_under_way() -> None:
    window = _Window([], delay_s=0.05)
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
