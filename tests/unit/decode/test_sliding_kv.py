"""A decode whose sliding-window layers keep only their window (`pdserve.decode.sliding_kv`):
a lease holds window slots for the blocks its first token reads, grows and lets go as it
decodes, and its transfer skips (and refuses) the sliding layers' blocks a window behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.decode.convert import lease_to_proto
from pdserve.decode.kv.receiver import KvChunkData, KvReceiver
from pdserve.decode.lease_state import RequestStatus
from pdserve.decode.leases import LeaseManager
from pdserve.decode.sliding_kv import SlidingKV
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.engine.window_slots import WindowSlots
from pdserve.kv.transfer import KvPiece, chunk_crc32c
from pdserve.kv.transports.shm import KvSegment, SharedKvPool

BLOCK_SIZE = 4
WINDOW = 8


def manager(num_blocks: int = 32, num_slots: int = 8) -> tuple[LeaseManager, WindowSlots]:
    slots = WindowSlots(num_slots, num_blocks, torch.device("cpu"))
    leases = LeaseManager(
        BlockPool(num_blocks),
        BLOCK_SIZE,
        reserve_tokens=0,
        ttl_s=10.0,
        is_insecure=True,
        sliding=SlidingKV(slots, WINDOW, BLOCK_SIZE),
    )
    return leases, slots


def test_a_lease_holds_slots_from_the_first_block_its_first_token_reads() -> None:
    leases, slots = manager()
    lease = leases.allocate("r", 40, 16)  # 10 blocks; the token at 40 reads 33.. (block 8 on)
    assert len(lease.block_ids) == 10 and lease.num_window_released == 8
    assert [slots.is_held(b) for b in lease.block_ids] == [False] * 8 + [True] * 2
    short = leases.allocate("s", 5, 16)  # 2 blocks, both read by the token at 5
    assert short.num_window_released == 0 and slots.num_held == 4
    leases.table.check_integrity()


def test_a_running_lease_grows_into_slots_and_lets_go_of_those_a_window_behind() -> None:
    leases, slots = manager()
    lease = leases.allocate("r", 16, 16)  # blocks 0..3; the token at 16 reads 9.. (block 2 on)
    assert lease.num_window_released == 2 and slots.num_held == 2
    for position in range(16, 27):  # one decode step per token, as the decode loop takes them
        assert leases.table.extend(lease, position + 1)
        lease.num_computed_tokens = position + 1
        leases.table.release_window(lease)
        first_read = (position + 1 - WINDOW + 1) // BLOCK_SIZE
        assert lease.num_window_released == first_read
        held = [b for b in lease.block_ids if slots.is_held(b)]
        assert held == lease.block_ids[first_read:]
        assert slots.num_held <= WINDOW // BLOCK_SIZE + 1
    assert leases.table.end(lease, RequestStatus.ABORTED)
    assert slots.num_held == 0 and leases.table.pool.num_used_blocks == 0


def test_slots_short_refuse_a_lease_and_stop_a_growth() -> None:
    leases, slots = manager(num_slots=5)
    first = leases.allocate("a", 8, 16)  # blocks 0..1 and a slot for the next: 3 needed
    assert slots.num_held == 2
    with pytest.raises(PdserveError) as refused:
        leases.allocate("b", 8, 16)  # 3 needed, 3 free of which 1 is owed to "a"
    assert refused.value.reason is ErrorReason.DECODE_CAPACITY_EXHAUSTED
    assert "3 window slots for its sliding layers, 2 available" in refused.value.message
    second = leases.allocate("c", 4, 16)  # one block: 2 needed
    assert slots.num_held == 3 and second.num_window_released == 0
    assert leases.table.extend(first, 9)  # the slot owed to it
    assert leases.table.extend(second, 5)  # the slot owed to it
    assert not leases.table.extend(first, 13)  # none left: the decode preempts instead
    assert slots.num_free == 0 and len(first.block_ids) == 3
    leases.table.check_integrity()


def test_blocks_are_not_shared_between_completions_of_a_prompt() -> None:
    leases, _ = manager()
    source = leases.allocate("a", 16, 4, share_key="k")
    source.status = RequestStatus.COMMITTED
    sibling = leases.allocate("b", 16, 4, share_key="k")
    assert sibling.num_shared_blocks == 0 and not set(sibling.block_ids) & set(source.block_ids)
    assert leases.pending_share_source("k") is None


def windowed_cache(num_blocks: int = 16) -> KVCache:
    layout = KVCacheLayout(
        num_layers=2, num_kv_heads=1, head_dim=2, block_size=BLOCK_SIZE, dtype="float32"
    )
    return KVCache(layout, num_blocks, torch.device("cpu"), window_layers=[0], num_window_slots=8)


def chunk(cache: KVCache, layer: int, first_block: int, num_blocks: int) -> KvChunkData:
    data = torch.full((num_blocks * cache.layout.block_nbytes // 4,), float(layer + first_block))
    key = data.numpy().tobytes()
    return KvChunkData(layer, first_block, num_blocks, key, key, chunk_crc32c(key, key))


def test_a_transfer_skips_and_refuses_the_sliding_layers_blocks_a_window_behind() -> None:
    cache = windowed_cache()
    assert cache.window_slots is not None
    leases = LeaseManager(
        BlockPool(16),
        BLOCK_SIZE,
        reserve_tokens=0,
        ttl_s=10.0,
        is_insecure=True,
        sliding=SlidingKV(cache.window_slots, WINDOW, BLOCK_SIZE),
    )
    lease = leases.allocate("r", 20, 4)  # 5 blocks; sliding layer 0 needs blocks 3 and 4
    leases.begin_sync(lease.lease_id, lease.lease_token, None)
    receiver = KvReceiver(cache, lease)
    with pytest.raises(PdserveError, match="sliding layer 0 include the lease's 3 blocks"):
        receiver.receive(chunk(cache, 0, 2, 2))
    receiver.receive(chunk(cache, 1, 0, 5))  # the full layer: every block
    with pytest.raises(PdserveError, match="never arrived"):
        receiver.commit(receiver.num_chunks, receiver.num_bytes, 20, 20)
    receiver.receive(chunk(cache, 0, 3, 2))
    receiver.commit(receiver.num_chunks, receiver.num_bytes, 20, 20)
    slot = cache.window_slots.slot_of(lease.block_ids[4])
    assert torch.equal(cache.layer(0)[0][slot], torch.full((BLOCK_SIZE, 1, 2), 3.0))


def test_shared_memory_writes_a_sliding_layer_through_the_leases_slots(tmp_path: Path) -> None:
    cache = windowed_cache()
    assert cache.window_slots is not None
    segment = KvSegment.create(cache, directory=tmp_path)
    sliding = SlidingKV(cache.window_slots, WINDOW, BLOCK_SIZE)
    leases = LeaseManager(
        BlockPool(16), BLOCK_SIZE, reserve_tokens=0, ttl_s=10.0, is_insecure=True, sliding=sliding
    )
    leases.allocate("other", 8, 4)  # so that the lease's slots are not its blocks' ids
    lease = leases.allocate("r", 20, 4)  # 5 blocks; sliding layer 0 keeps blocks 3 and 4
    message = lease_to_proto(lease, BLOCK_SIZE, 10.0, "d", (), cache.window_slots)
    assert message.num_window_skipped_blocks == 3 and message.num_window_slots == 8
    assert list(message.window_slot_ids) == [
        cache.window_slots.slot_of(b) for b in lease.block_ids[3:]
    ]
    pool = SharedKvPool(segment.name, cache.layout, tmp_path, window_layers=[0], num_window_slots=8)
    assert pool.num_blocks == 16
    writer = pool.window(lease.block_ids, 0, 3, message.window_slot_ids)
    for layer, first, count in ((1, 0, 5), (0, 3, 2)):
        data = chunk(cache, layer, first, count)
        piece = KvPiece(layer, first, count, memoryview(data.key), memoryview(data.value))
        assert writer.write(piece) == data.crc32c
        for block in range(first, first + count):
            exported = cache.export_blocks(layer, [lease.block_ids[block]])
            assert bytes(exported.k) == data.key[: cache.layout.block_nbytes]
    with pytest.raises(IndexError, match="layer 0 include the lease's 3 leading blocks"):
        writer.write(KvPiece(0, 2, 1, memoryview(data.key[:32]), memoryview(data.key[:32])))
    segment.remove()
