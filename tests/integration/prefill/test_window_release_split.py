"""Sliding-window layers through the split (issue 50's measure): a decode that keeps only their
window (``--release-window-blocks``, its default) holds under half the memory of a long
request on a Gemma-3-shaped model, receives those layers' KV for the window only, and gives
the same tokens as a decode that keeps every layer's blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from support.prefill_cluster import BLOCK_SIZE, cluster, reference_engine
from support.tiny_models import GEMMA3_SHAPED, save_tiny_model

from pdserve.common.errors import ErrorReason
from pdserve.common.generation import SamplingParams, num_blocks_for
from pdserve.decode.request import DecodeRequest
from pdserve.decode.sliding_kv import SlidingKV
from pdserve.v1 import decode_pb2

PROMPT = [3 + (i * 7) % 250 for i in range(4096)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
WINDOW = GEMMA3_SHAPED["sliding_window"]


@pytest.fixture(scope="module")
def gemma3_shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five sliding layers of window 512 to one global, as Gemma 3 has them."""
    path = tmp_path_factory.mktemp("gemma3-shaped")
    return save_tiny_model("gemma3", path, **GEMMA3_SHAPED)


async def serve(
    model: Path, transport: str, release: bool, decode_tp: int = 1
) -> tuple[list[int], Any]:
    """The tokens of `PROMPT` through a prefill and a decode (over `decode_tp` ranks), and the
    decode."""
    decode = {"max_num_seqs": 2, "release_window_blocks": release, "kv_transports": transport}
    async with cluster(
        model,
        decode_blocks=num_blocks_for(len(PROMPT) + 64, BLOCK_SIZE),
        decode_overrides=decode,
        num_blocks=num_blocks_for(len(PROMPT) + 64, BLOCK_SIZE),
        max_num_batched_tokens=1024,
        kv_transports=transport,
        decode_tp=decode_tp,
    ) as pd:
        tokens = await pd.complete("long", PROMPT, GREEDY)
        await pd.eventually_whole()
        return tokens, pd.decodes[0]


_EVERY_BLOCK: dict[Path, tuple[list[int], int]] = {}


async def every_block(model: Path) -> tuple[list[int], int]:
    """The tokens of `PROMPT` and the KV bytes received by a decode keeping every layer's
    blocks (`--no-release-window-blocks`): computed once for the module's cases."""
    if model not in _EVERY_BLOCK:
        tokens, decode = await serve(model, "tcp", release=False)
        assert decode.host.runner.kv_cache.window_slots is None
        _EVERY_BLOCK[model] = tokens, decode.servicer.num_kv_bytes_received
    return _EVERY_BLOCK[model]


@pytest.mark.parametrize(
    ("transport", "decode_tp"), [("shm", 1), ("nixl", 1), ("tcp", 1), ("shm", 2)]
)
async def test_a_long_request_holds_under_half_the_memory_and_the_same_tokens(
    gemma3_shaped: Path, transport: str, decode_tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[float] = []
    release = SlidingKV.release

    def measured(self: SlidingKV, lease: DecodeRequest) -> None:
        # NOTE: what the running request holds after each step: every block for the global
        # layer, its slots (blocks not let go) for the five sliding ones; against all six.
        release(self, lease)
        num_blocks = len(lease.block_ids)
        num_slots = num_blocks - lease.num_window_released
        held.append((num_blocks * 1 + num_slots * 5) / (num_blocks * 6))

    monkeypatch.setattr(SlidingKV, "release", measured)
    tokens, decode = await serve(gemma3_shaped, transport, release=True, decode_tp=decode_tp)
    whole_tokens, whole_bytes = await every_block(gemma3_shaped)
    assert tokens == whole_tokens and len(tokens) == GREEDY.max_tokens
    assert decode.host.runner.kv_cache.window_slots is not None
    # NOTE: 1,024 prompt blocks of the global layer and a window's 129 of each sliding one:
    # (1024 + 5 * 129) / (6 * 1024) = 0.27.
    assert len(held) == GREEDY.max_tokens - 1 and max(held) <= 0.5
    num_prompt_blocks = num_blocks_for(len(PROMPT), BLOCK_SIZE)
    num_window_blocks = num_prompt_blocks - (len(PROMPT) - WINDOW + 1) // BLOCK_SIZE
    layer_block = 2 * decode.host.runner.kv_cache.layout.block_nbytes
    assert whole_bytes == 6 * num_prompt_blocks * layer_block
    assert decode.servicer.num_kv_bytes_received == layer_block * (
        num_prompt_blocks + 5 * num_window_blocks
    )


async def test_a_lease_short_of_window_slots_is_refused_with_a_retry_delay(
    tmp_path: Path,
) -> None:
    """A decode with window slots for one request (``--max-num-seqs 1``, Gemma 3's window of
    24 tokens): while one long prompt's lease holds them, another is refused with
    DECODE_CAPACITY_EXHAUSTED and a retry delay (the gateway asks again or elsewhere); once
    that lease ends, the prompt continues as the single-process engine does."""
    model = save_tiny_model("gemma3", tmp_path / "gemma3")
    prompt = [(11 * i) % 290 + 5 for i in range(41)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (expected,) = reference_engine(model).generate([prompt], greedy)
    async with cluster(model, decode_overrides={"max_num_seqs": 1}) as pd:
        decode = pd.decodes[0]
        slots = decode.host.runner.kv_cache.window_slots
        assert slots is not None and slots.num_slots == 8
        held = await pd.allocate(len(prompt), "holder")
        # 11 blocks, the last 7 a window's (blocks 4..10 for the token at 41): 7 slots held
        assert held.num_window_skipped_blocks == 4 and len(held.window_slot_ids) == 7
        refused = await pd.run_prefill(pd.request("w", prompt, greedy))
        assert refused.error is not None
        assert refused.error.reason is ErrorReason.DECODE_CAPACITY_EXHAUSTED
        assert "window slots" in refused.error.message and refused.error.retry_delay_s
        await pd.decode_stubs[0].ReleaseLease(
            decode_pb2.ReleaseLeaseRequest(
                lease_id=held.lease_id, request_id="holder", lease_token=held.transports[-1].token
            )
        )
        assert slots.num_held == 0
        scraped = generate_latest(decode.metrics.registry).decode()
        assert "pdserve_decode_window_slots 8.0" in scraped
        assert "pdserve_decode_window_slots_free 8.0" in scraped
        assert await pd.complete("w", prompt, greedy) == expected
        assert decode.loop.num_preemptions == 0
        await pd.eventually_whole()
        assert slots.num_held == 0
