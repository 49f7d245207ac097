"""Sliding-window layers that keep only their window (`CacheConfig.release_window_blocks`):
the slot pool itself, the colocated engine's tokens with and without it, and the memory a long
request holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.tiny_models import GEMMA3_SHAPED, save_tiny_model

from pdserve.common.generation import SamplingParams
from pdserve.engine import LLMEngine
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.window_slots import WindowSlots

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_slots_are_held_let_go_and_taken_again_least_recently_let_go_first() -> None:
    slots = WindowSlots(3, 10, torch.device("cpu"))
    slots.hold([4, 5])
    assert slots.num_held == 2 and slots.is_held(4) and not slots.is_mapped(6)
    slots.hold([4])  # a second holder
    slots.let_go([4, 5])
    assert slots.is_held(4) and not slots.is_held(5) and slots.is_mapped(5)
    assert slots.num_to_take([5, 6]) == 2  # 5 is mapped but free: holding it takes a free slot
    slots.hold([6])  # the never-mapped slot first
    slots.hold([7])  # then the least recently let go: 5's
    assert not slots.is_mapped(5) and slots.slot_table[5] == 0
    assert slots.slot_table[7] == slots.slot_of(7)
    with pytest.raises(ValueError, match="1 window slots needed, 0 free"):
        slots.hold([8])
    with pytest.raises(ValueError, match="not held"):
        slots.let_go([5])
    slots.let_go([6])
    slots.forget(6)  # its id now holds other tokens: the slot is the next one taken
    slots.let_go([7])
    slots.hold([9])
    assert not slots.is_mapped(6) and slots.is_mapped(7)


def engine(model: Path, *, release: bool, num_blocks: int = 96, prefix: bool = False) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            cache=CacheConfig(
                block_size=4,
                num_blocks=num_blocks,
                max_seqs=4,
                enable_prefix_caching=prefix,
                release_window_blocks=release,
            ),
            # NOTE: 16-token chunks: a 60-token prompt is prefilled over several steps, each
            # reading the window the chunk before it wrote.
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        )
    )


PROMPTS = [list(range(3, 63)), list(range(100, 131)), [7, 8, 9]]


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "mistral"])
def test_the_same_tokens_while_the_sliding_layers_let_their_blocks_go(
    family: str, checkpoint: Callable[[str], Path]
) -> None:
    """Windows of 24 tokens (six blocks of 4) under prompts of 60 and 40 tokens generated:
    every sliding layer reads only what its window holds, and gives the same tokens."""
    model = checkpoint(family)
    expected = engine(model, release=False).generate(PROMPTS, GREEDY)
    windowed = engine(model, release=True)
    slots = windowed.kv_cache.window_slots
    assert slots is not None
    held: list[tuple[int, int]] = []
    requests = [windowed.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    results: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while windowed.has_unfinished_requests():
        for output in windowed.step():
            results[output.request_id].extend(output.new_token_ids)
        held.append((slots.num_held, sum(len(r.block_ids) for r in requests)))
    assert [results[r.request_id] for r in requests] == expected
    # NOTE: a sequence holds at most a chunk plus a window: (16 + 24) / 4 + 1 slots; decoding,
    # a window and the block being written: 24 / 4 + 2.
    assert max(slots for slots, _ in held) <= len(PROMPTS) * 11 and held[-1][0] == 0
    slots_at_most_blocks, most_blocks = max(held, key=lambda pair: pair[1])
    assert most_blocks >= 48 and slots_at_most_blocks <= len(PROMPTS) * 8


def test_a_prefix_hit_ends_where_the_window_before_it_still_has_its_slots(
    checkpoint: Callable[[str], Path],
) -> None:
    model = checkpoint("gemma3")
    expected = engine(model, release=False).generate(PROMPTS[:1], GREEDY)
    windowed = engine(model, release=True, prefix=True)
    assert windowed.generate(PROMPTS[:1], GREEDY) == expected
    # NOTE: the let-go slots still hold their blocks until taken: the whole prompt hits
    # (but its last token) and gives the same tokens.
    request = windowed.add_request("again", PROMPTS[0], GREEDY)
    hit, num_hit_tokens = windowed.kv_cache_manager.get_computed_blocks(request)
    assert num_hit_tokens == 56
    windowed.abort_request("again")
    assert windowed.generate(PROMPTS[:1], GREEDY) == expected
    # With the window's slots taken by other requests the hit stops before that window.
    slots = windowed.kv_cache.window_slots
    assert slots is not None
    for block_id in hit[-3:]:
        slots.forget(block_id)
    request = windowed.add_request("third", PROMPTS[0], GREEDY)
    hit, num_hit_tokens = windowed.kv_cache_manager.get_computed_blocks(request)
    first = windowed.kv_cache_manager.first_in_window(num_hit_tokens)
    assert num_hit_tokens < 56 and all(slots.is_mapped(b) for b in hit[first:])
    windowed.abort_request("third")
    assert windowed.generate(PROMPTS[:1], GREEDY) == expected


def test_a_long_request_on_a_gemma3_shaped_model_holds_under_half_the_memory(
    tmp_path: Path,
) -> None:
    """Five sliding layers of window 512 to one global, a 4,096-token prompt: the bytes its
    blocks and window slots take, against every layer keeping every block."""
    save_tiny_model("gemma3", tmp_path, **GEMMA3_SHAPED)
    config = EngineConfig(
        model=str(tmp_path),
        dtype="float32",
        cache=CacheConfig(num_blocks=300, max_seqs=1, release_window_blocks=True),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512),
    )
    windowed = LLMEngine(config)
    cache, slots = windowed.kv_cache, windowed.kv_cache.window_slots
    assert slots is not None and cache.window_layers == (0, 1, 2, 3, 4)
    prompt = [3 + (i * 7) % 250 for i in range(4096)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    request = windowed.add_request("long", prompt, params)
    ratios = []
    per_layer_block = cache.layout.total_block_nbytes / cache.layout.num_layers
    while windowed.has_unfinished_requests():
        windowed.step()
        if not request.is_finished and request.num_computed_tokens >= len(prompt):
            held_bytes = per_layer_block * (
                len(request.block_ids) * 1 + slots.num_held * len(cache.window_layers)
            )
            whole_bytes = cache.layout.total_block_nbytes * len(request.block_ids)
            ratios.append(held_bytes / whole_bytes)
    # NOTE: 257 blocks of the global layer, and a window's 32-33 slots for each of the five
    # sliding ones: (257 + 5 * 33) / (6 * 257) = 0.27.
    assert len(ratios) == 7 and max(ratios) <= 0.5


def test_a_window_layer_exports_and_imports_its_blocks_through_their_slots() -> None:
    from pdserve.engine.kv_cache import KVCache, KVCacheLayout

    layout = KVCacheLayout(num_layers=3, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32")
    cache = KVCache(layout, 8, torch.device("cpu"), window_layers=[0, 2], num_window_slots=2)
    slots = cache.window_slots
    assert slots is not None and cache.kv.shape[0] == 1 and cache.window_kv.shape[:3] == (2, 2, 2)
    slots.hold([6])
    k = torch.arange(8, dtype=torch.float32)
    cache.import_blocks(2, [6], k.numpy().tobytes(), (k + 100).numpy().tobytes())
    cache.import_blocks(1, [6], (k + 1).numpy().tobytes(), (k + 2).numpy().tobytes())
    exported = cache.export_blocks(2, [6])
    assert bytes(exported.k) == k.numpy().tobytes()
    assert torch.equal(cache.layer(2)[1][slots.slot_of(6)].flatten(), k + 100)
    assert torch.equal(cache.layer(1)[0][6].flatten(), k + 1)  # a full layer: by block id
    with pytest.raises(KeyError, match="block 5 has no window slot"):
        cache.export_blocks(0, [5])
    # Placed in a buffer (a shared-memory segment), the window storage follows the blocks'.
    buffer = bytearray(cache.nbytes)
    cache.place_in(memoryview(buffer))
    assert bytes(cache.export_blocks(2, [6]).k) == k.numpy().tobytes()
    slot_bytes = 2 * 2 * 2 * (2 * 4) * 4  # [2 window layers][K, V][2 slots][2 x 4 floats]
    assert cache.window_kv.data_ptr() - cache.kv.data_ptr() == len(buffer) - slot_bytes
    assert buffer[-slot_bytes:] == cache.window_kv.numpy().tobytes()
