"""An in-place sender announces a run of pieces as one chunk (`chunk_runs`): its checksum
(`run_crc32c`) is the one the decode computes over the run's blocks in its cache
(`blocks_crc32c`), whatever the blocks' ids there, and a run never spans two layers or a gap."""

from __future__ import annotations

import torch

from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transfer import (
    KvPiece,
    blocks_crc32c,
    chunk_crc32c,
    chunk_runs,
    run_crc32c,
    sequence_pieces,
)

LAYOUT = KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
# K+V bytes of a piece of 2 blocks
PIECE = 2 * 2 * LAYOUT.block_nbytes


def _sender() -> tuple[KVCache, list[int]]:
    cache = KVCache(LAYOUT, 12, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape))
    return cache, [3, 4, 5, 9, 10, 0, 1]  # NOTE: 7 blocks, not in order


def test_the_pieces_of_one_layer_in_order_are_one_run_each_layer_its_own() -> None:
    cache, block_ids = _sender()
    pieces = list(sequence_pieces(cache, block_ids, PIECE))
    runs = chunk_runs(pieces)
    assert [[p.layer_index for p in run] for run in runs] == [[0] * 4, [1] * 4, [2] * 4]
    assert [p for run in runs for p in run] == pieces
    # NOTE: a gap (a piece left out) or a repeated block starts a new run
    gapped = [p for p in pieces if not (p.layer_index == 0 and p.first_block == 2)]
    assert [len(run) for run in chunk_runs(gapped)] == [1, 2, 4, 4]
    again = [pieces[0], pieces[0]]
    assert [len(run) for run in chunk_runs(again)] == [1, 1]


def test_a_runs_checksum_is_the_decodes_over_its_blocks() -> None:
    cache, block_ids = _sender()
    decode = KVCache(LAYOUT, 16, torch.device("cpu"))
    leased = [15, 2, 3, 7, 8, 9, 1]
    for run in chunk_runs(list(sequence_pieces(cache, block_ids, PIECE))):
        first, num_blocks = run[0].first_block, sum(p.num_blocks for p in run)
        for piece in run:
            ids = leased[piece.first_block : piece.first_block + piece.num_blocks]
            decode.import_blocks(piece.layer_index, ids, piece.key, piece.value)
        on_decode = blocks_crc32c(decode, run[0].layer_index, leased[first : first + num_blocks])
        assert run_crc32c(run) == on_decode
        key = b"".join(bytes(p.key) for p in run)
        value = b"".join(bytes(p.value) for p in run)
        assert run_crc32c(run) == chunk_crc32c(key, value)


def test_one_piece_is_a_run_whose_checksum_is_the_pieces() -> None:
    key, value = memoryview(bytes(range(256)) * 4), memoryview(bytes(range(255, -1, -1)) * 4)
    piece = KvPiece(0, 0, 1, key, value)
    assert chunk_runs([piece]) == [[piece]]
    assert run_crc32c([piece]) == chunk_crc32c(piece.key, piece.value)
