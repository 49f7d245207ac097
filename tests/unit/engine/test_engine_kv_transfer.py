"""KV export/import between engines, its byte layout, and the per-layer callback."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from pdserve.engine import (
    LLMEngine,
    SamplingParams,
    ScheduledChunk,
    logical_blocks_touched,
)

EngineFactory = Callable[..., LLMEngine]
PromptFactory = Callable[..., list[list[int]]]


def prefill_only(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> int:
    """Runs steps until the request has its first token; returns it."""
    engine.add_request(request_id, prompt, params)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.new_token_ids:
                return output.new_token_ids[0]


def finish(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        engine.block_pool.check_integrity()
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(
            temperature=0.9, top_k=50, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True
        ),
    ],
    ids=["greedy", "seeded"],
)
def test_imported_kv_continues_exactly_like_the_source_engine(
    params: SamplingParams, make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    prompt = prompts(1, seed=12, min_len=53, max_len=53)[0]
    source = make_engine("llama3", max_num_batched_tokens=20)  # chunked prefill on the source
    first_token = prefill_only(source, "r", prompt, params)
    source_blocks = list(source.scheduler.requests["r"].block_ids)
    num_blocks = len(source_blocks)
    assert num_blocks == 4

    target = make_engine("llama3", num_blocks=64)  # its own model copy and cache
    placeholder = target.block_pool.allocate(7)
    target_blocks = target.block_pool.allocate(num_blocks)
    random.Random(1).shuffle(target_blocks)
    target.block_pool.free(placeholder)
    assert set(target_blocks).isdisjoint(source_blocks)
    for layer in range(source.kv_cache.layout.num_layers):
        # Ship each layer in two runs of logical blocks, as the data plane does.
        for run in (slice(0, 1), slice(1, num_blocks)):
            data = source.kv_cache.export_blocks(layer, source_blocks[run])
            target.kv_cache.import_blocks(layer, target_blocks[run], bytes(data.k), bytes(data.v))

    target.add_request(
        "r",
        prompt,
        params,
        output_token_ids=[first_token],
        block_ids=target_blocks,
        num_computed_tokens=len(prompt),
    )
    continued = finish(target)["r"]
    reference = finish(source)["r"]
    assert len(continued) == params.max_tokens - 1
    assert continued == reference
    assert target.block_pool.num_free_blocks == target.block_pool.num_blocks


def test_export_layout_is_blocks_of_block_size_heads_dim(make_engine: EngineFactory) -> None:
    engine = make_engine("llama3", num_blocks=16)
    cache = engine.kv_cache
    cache.kv.copy_(torch.randn_like(cache.kv))
    layout = cache.layout
    assert layout.block_nbytes == layout.block_size * layout.num_kv_heads * layout.head_dim * 4
    for block_ids in ([3, 4, 5], [9, 2, 7]):  # a contiguous run and a gather
        data = engine.kv_cache.export_blocks(1, block_ids)
        assert len(data.k) == len(data.v) == len(block_ids) * layout.block_nbytes
        expected_k = b"".join(cache.kv[1, 0, b].numpy().tobytes() for b in block_ids)
        expected_v = b"".join(cache.kv[1, 1, b].numpy().tobytes() for b in block_ids)
        assert bytes(data.k) == expected_k
        assert bytes(data.v) == expected_v


def test_contiguous_export_is_zero_copy(make_engine: EngineFactory) -> None:
    engine = make_engine("llama3", num_blocks=16)
    data = engine.kv_cache.export_blocks(0, [2, 3])
    engine.kv_cache.kv[0, 0, 2].fill_(1.5)
    assert torch.frombuffer(bytearray(data.k), dtype=torch.float32)[0] == 1.5


def test_import_round_trips_bfloat16_and_checks_sizes(make_engine: EngineFactory) -> None:
    source = make_engine("qwen2", num_blocks=8, dtype="bfloat16")
    target = make_engine("qwen2", num_blocks=8, dtype="bfloat16")
    source.kv_cache.kv.copy_(torch.randn_like(source.kv_cache.kv))
    data = source.kv_cache.export_blocks(0, [1, 6])
    target.kv_cache.import_blocks(0, [5, 0], data.k, data.v)
    assert torch.equal(target.kv_cache.kv[0, :, 5], source.kv_cache.kv[0, :, 1])
    assert torch.equal(target.kv_cache.kv[0, :, 0], source.kv_cache.kv[0, :, 6])
    with pytest.raises(ValueError, match="expected"):
        target.kv_cache.import_blocks(0, [5], data.k, data.v)


def test_layer_callback_runs_after_each_layers_kv_is_written(
    make_engine: EngineFactory, prompts: PromptFactory
) -> None:
    engine = make_engine("mistral", num_blocks=16)
    cache = engine.kv_cache.kv
    prompt = prompts(1, seed=3, min_len=20, max_len=20)[0]
    block_ids = engine.block_pool.allocate(2)
    seen: list[tuple[int, list[bool]]] = []

    def on_layer_done(layer: int) -> None:
        written = [bool(cache[i, :, block_ids[0]].abs().sum() > 0) for i in range(cache.shape[0])]
        seen.append((layer, written))

    engine.runner.execute([ScheduledChunk(prompt, 0, block_ids)], on_layer_done)
    num_layers = cache.shape[0]
    assert [layer for layer, _ in seen] == list(range(num_layers))
    for layer, written in seen:
        assert written == [i <= layer for i in range(num_layers)]


def test_logical_blocks_touched_by_a_chunk() -> None:
    assert logical_blocks_touched(0, 16, 16) == range(0, 1)
    assert logical_blocks_touched(15, 2, 16) == range(0, 2)
    assert logical_blocks_touched(32, 1, 16) == range(2, 3)


def test_adopting_blocks_not_allocated_from_the_pool_is_refused(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine("llama3", num_blocks=16)
    with pytest.raises(ValueError, match="allocated"):
        engine.add_request("r", [5, 6, 7], block_ids=[3], num_computed_tokens=3)
    with pytest.raises(ValueError, match="cannot hold"):
        engine.add_request(
            "r", list(range(3, 40)), block_ids=engine.block_pool.allocate(1), num_computed_tokens=30
        )
    assert not engine.has_unfinished_requests()
