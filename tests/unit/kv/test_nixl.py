"""The NIXL transport's ends in one process: a decode's registered cache, a prefill's window
onto one lease of it, one-sided WRITEs that land exactly in the leased blocks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transfer import blocks_crc32c, layer_pieces, sequence_pieces
from pdserve.kv.transports.nixl_window import NixlWindow

nixl = pytest.importorskip("pdserve.kv.transports.nixl")
try:
    nixl.load_api()
except nixl.NixlUnavailable as missing:
    pytest.skip(f"{missing}", allow_module_level=True)

LAYOUT = KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


@pytest.fixture(scope="module")
def ends() -> Iterator[tuple[nixl.CacheAgent, nixl.NixlPeers]]:
    decode = nixl.CacheAgent(KVCache(LAYOUT, 16, torch.device("cpu")), "decode")
    source = KVCache(LAYOUT, 16, torch.device("cpu"))
    source.kv.copy_(torch.randn(source.kv.shape))
    prefill = nixl.CacheAgent(source, "prefill")
    # NOTE: the decode's agent progresses while transfers into it are open (its servicer holds
    # it from a NIXL header to the blocks' release).
    release = decode.progress.hold()
    yield decode, nixl.NixlPeers(prefill)
    release()
    decode.close()
    prefill.close()


def test_a_lease_written_through_its_window_is_the_senders_kv_and_nothing_else(
    ends: tuple[nixl.CacheAgent, nixl.NixlPeers],
) -> None:
    decode, peers = ends
    decode.kv_cache.kv.zero_()
    source = peers.local.kv_cache
    sender_blocks = [3, 4, 9, 1]  # the prefill's blocks, in the sequence's order
    leased = [7, 8, 2, 11]  # the decode's
    window = NixlWindow(peers, decode.target(leased))
    crcs = [window.write(p) for p in sequence_pieces(source, sender_blocks, 2 * 2 * 128)]
    window.wait()
    for layer in range(LAYOUT.num_layers):
        for kv in (0, 1):
            assert torch.equal(
                decode.kv_cache.kv[layer, kv, leased], source.kv[layer, kv, sender_blocks]
            )
    untouched = [b for b in range(16) if b not in leased]
    assert not decode.kv_cache.kv[:, :, untouched].any()
    assert crcs[0] == blocks_crc32c(decode.kv_cache, 0, leased[:1])


def test_a_window_cannot_address_blocks_outside_its_lease_or_its_shared_blocks(
    ends: tuple[nixl.CacheAgent, nixl.NixlPeers],
) -> None:
    decode, peers = ends
    source = peers.local.kv_cache
    window = NixlWindow(peers, decode.target([5, 6]), num_shared_blocks=1)
    (outside,) = layer_pieces(source, 0, [0, 1, 2], 1, first_block=2)
    with pytest.raises(IndexError, match="outside"):
        window.write(outside)
    (shared,) = layer_pieces(source, 0, [0, 1], 1, first_block=0, end_block=1)
    with pytest.raises(IndexError, match="shared"):
        window.write(shared)


def test_a_corrupting_write_lands_a_flipped_byte_after_the_checksum(
    ends: tuple[nixl.CacheAgent, nixl.NixlPeers],
) -> None:
    decode, peers = ends
    (piece,) = layer_pieces(peers.local.kv_cache, 1, [2], 1)
    window = NixlWindow(peers, decode.target([4]))
    crc = window.write(piece, corrupt=True)
    window.wait()
    assert blocks_crc32c(decode.kv_cache, 1, [4]) != crc
    window.write(piece)
    window.wait()
    assert blocks_crc32c(decode.kv_cache, 1, [4]) == crc


def test_a_target_that_makes_no_progress_leaves_a_write_undone_until_the_timeout(
    ends: tuple[nixl.CacheAgent, nixl.NixlPeers],
) -> None:
    decode, peers = ends
    (piece,) = layer_pieces(peers.local.kv_cache, 0, [3], 1)
    release = decode.progress.hold()
    release()
    release()  # NOTE: a second call changes nothing
    assert decode.progress.num_open == 1  # the fixture's hold
    idle = nixl.CacheAgent(KVCache(LAYOUT, 4, torch.device("cpu")), "decode")
    try:
        window = NixlWindow(peers, idle.target([1]), timeout_s=0.5)
        window.write(piece)
        with pytest.raises(nixl.NixlUnavailable, match="not done"):
            window.wait()
    finally:
        idle.close()


def test_a_write_outside_the_decodes_registered_cache_is_refused_by_the_senders_agent(
    ends: tuple[nixl.CacheAgent, nixl.NixlPeers],
) -> None:
    decode, peers = ends
    target = decode.target([0])
    beyond = decode.base_address + decode.kv_cache.nbytes  # the first byte after the cache
    forged = nixl.NixlTarget(**{**target.__dict__, "block_addresses": (beyond,)})
    window = NixlWindow(peers, forged)
    (piece,) = layer_pieces(peers.local.kv_cache, 0, [0], 1)
    window.write(piece)
    with pytest.raises(nixl.NixlUnavailable):
        window.wait()


def test_a_peer_with_another_block_size_is_refused(
    ends: tuple[nixl.CacheAgent, nixl.NixlPeers],
) -> None:
    decode, peers = ends
    target = decode.target([1])
    with pytest.raises(nixl.NixlUnavailable, match="bytes"):
        NixlWindow(
            peers, nixl.NixlTarget(**{**target.__dict__, "block_nbytes": target.block_nbytes * 2})
        )


def test_a_decode_keeping_only_the_window_gets_its_sliding_layers_kv_in_their_slots(
    ends: tuple[nixl.CacheAgent, nixl.NixlPeers],
) -> None:
    _, peers = ends
    source = peers.local.kv_cache
    # Layers 0 and 2 slide (window storage of 4 slots), layer 1 keeps every block.
    cache = KVCache(LAYOUT, 16, torch.device("cpu"), window_layers=[0, 2], num_window_slots=4)
    assert cache.window_slots is not None
    leased = [7, 8, 2, 11]
    cache.window_slots.hold([5, 6])  # another lease's, so that slots are not block ids
    cache.window_slots.hold(leased[2:])  # the lease keeps the window's blocks only
    decode = nixl.CacheAgent(cache, "decode")
    release = decode.progress.hold()
    try:
        target = decode.target().for_blocks(
            leased, [cache.window_slots.slot_of(b) for b in leased[2:]]
        )
        assert target.num_window_skipped == 2 and target.window_layers == (0, 2)
        window = NixlWindow(peers, target)
        sender_blocks = [3, 4, 9, 1]
        pieces = sequence_pieces(
            source,
            sender_blocks,
            2 * 2 * 128,
            window_layers=frozenset({0, 2}),
            first_window_block=2,
        )
        for piece in pieces:
            window.write(piece)
        window.wait()
        for layer in range(LAYOUT.num_layers):
            blocks = range(4) if layer == 1 else range(2, 4)
            for block in blocks:
                assert bytes(cache.export_blocks(layer, [leased[block]]).k) == bytes(
                    source.export_blocks(layer, [sender_blocks[block]]).k
                )
        (behind,) = layer_pieces(source, 2, sender_blocks, 1, first_block=1, end_block=2)
        with pytest.raises(IndexError, match="layer 2 include the lease's 2 leading blocks"):
            window.write(behind)  # no window storage for it on the decode
    finally:
        release()
        decode.close()
