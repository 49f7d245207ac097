"""A cache exported by one process and written by another: bit-exact blocks in the exporter's
cache, untouched blocks left alone, the mapping closed once the exporter is gone. On CPU with
the stand-in (make test) and on CUDA through CUDA IPC (the GPU run)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from support import ipc_peer

from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transfer import layer_pieces
from pdserve.kv.transports.cuda_ipc_window import MappedCaches

LAYOUT = KVCacheLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
NUM_BLOCKS = 32


class Peer:
    """The exporting process (`support.ipc_peer`)."""

    def __init__(self, device: str) -> None:
        layout = json_layout(LAYOUT)
        self.process = subprocess.Popen(
            [sys.executable, ipc_peer.__file__, device, str(NUM_BLOCKS), layout],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.handle = ipc_peer.read_handle(self.process.stdout)

    def digest(self, block_ids: list[int]) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"digest {','.join(map(str, block_ids))}\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def stop(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(30)


def json_layout(layout: KVCacheLayout) -> str:
    return json.dumps(dataclasses.asdict(layout))


@pytest.fixture(
    params=[pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)],
)
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return str(request.param)


@pytest.fixture
def peer(device: str) -> Iterator[Peer]:
    running = Peer(device)
    yield running
    running.stop()


def test_blocks_written_through_the_handle_land_bit_exact_in_the_exporter(
    device: str, peer: Peer
) -> None:
    assert peer.handle.device_kind.split(":")[0] == device
    source = KVCache(LAYOUT, 12, torch.device(device))
    source.kv.normal_()
    caches = MappedCaches(source)
    assert caches.can_map(peer.handle)
    lease_ids, source_ids = [30, 3, 4, 5, 17, 9], [11, 0, 1, 2, 7, 5]
    window = caches.open(peer.handle).window(lease_ids, 0, source)
    for layer in range(LAYOUT.num_layers):
        for piece in layer_pieces(source, layer, source_ids, 4):
            window.write(piece)
        window.wait()
    assert peer.digest(lease_ids) == ipc_peer.blocks_digest(source.kv, source_ids)
    untouched = [b for b in range(NUM_BLOCKS) if b not in lease_ids][:4]
    zeros = torch.zeros_like(source.kv[:, :, :4])
    assert peer.digest(untouched) == ipc_peer.blocks_digest(zeros, [0, 1, 2, 3])


def test_the_mapping_is_closed_once_the_exporter_is_gone(device: str, peer: Peer) -> None:
    caches = MappedCaches(KVCache(LAYOUT, 4, torch.device(device)))
    cache = caches.open(peer.handle)
    assert caches.close_lost() == 0
    peer.stop()
    assert caches.close_lost() == 1
    assert cache.kv is None and len(caches) == 0
