"""The KV storage tier with real services and real KV: offload on preemption, load on reschedule.

A decode preempted mid-stream offloads the request's blocks; the gateway reschedules it with the
prompt and the tokens so far, and the prefill loads the stored blocks and computes only what
follows them. Whatever the store does (corrupt entries, down), the answer equals the engine's.
The prefills run with their local prefix cache off, so every reused block comes from the store.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.real_cluster import BLOCK_SIZE, MODEL_NAME, RealCluster, Reference
from support.redis_server import RedisServer, running_redis

from pdserve.decode.events import PreemptionReason
from pdserve.kv.codec import HEADER_NBYTES

PROMPT = "The storage tier keeps the KV cache of preempted requests for the next prefill."
MAX_TOKENS = 120
PREEMPT_AFTER = 40  # tokens streamed before the decode is told to preempt


@pytest.fixture(scope="module")
def reference(demo_model_dir: Path) -> Reference:
    return Reference(demo_model_dir)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_redis(tmp_path) as server:
        yield server


@pytest.fixture(params=["file", "redis"])
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file:{tmp_path / 'kv'}"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.spec


async def _cluster(demo_model_dir: Path, spec: str | None, **options: Any) -> RealCluster:
    settings = {} if spec is None else {"kv_store": spec}
    return await RealCluster(demo_model_dir).start(
        instance_settings=settings, prefill_settings={"prefix_cache": False}, **options
    )


@pytest.fixture
async def stored(demo_model_dir: Path, store_spec: str) -> AsyncIterator[RealCluster]:
    cluster = await _cluster(demo_model_dir, store_spec)
    try:
        yield cluster
    finally:
        await cluster.close()


async def _stream(cluster: RealCluster, prompt: str, preempt_after: int | None) -> list[int]:
    """Streams a greedy completion; after `preempt_after` tokens the decode preempts it."""
    ids: list[int] = []
    chunks = await cluster.openai().completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    async for chunk in chunks:
        for choice in chunk.choices:
            ids.extend(choice.model_extra["token_ids"])
        if preempt_after is not None and len(ids) >= preempt_after:
            preempt_after = None
            for decode in cluster.decodes:
                decode.loop.preempt_all(PreemptionReason.OUT_OF_BLOCKS)
    return ids


async def _expected(reference: Reference, prompt: str = PROMPT) -> list[int]:
    return await asyncio.to_thread(
        reference.completion, prompt, temperature=0.0, max_tokens=MAX_TOKENS
    )


async def test_rescheduled_request_computes_only_past_its_stored_prefix(
    stored: RealCluster, reference: Reference
) -> None:
    prefill, decode = stored.prefills[0], stored.decodes[0]
    num_prompt = len(reference.tokenizer.encode(PROMPT))
    ids = await _stream(stored, PROMPT, PREEMPT_AFTER)
    assert ids == await _expected(reference)
    assert stored.gateway is not None
    assert decode.offload is not None and decode.offload.num_written == 1
    # The reschedule's tokens: the prompt and what was generated before the notice.
    scheduler = prefill.loop.scheduler
    num_loaded = scheduler.num_loaded_prompt_tokens
    num_rescheduled = prefill.loop.num_prompt_tokens - num_prompt + num_loaded
    assert num_rescheduled >= num_prompt + PREEMPT_AFTER
    # Every full block but the one holding the last token came from the store.
    assert num_loaded == (num_rescheduled - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert prefill.loop.num_prompt_tokens - num_prompt == num_rescheduled - num_loaded
    assert num_rescheduled - num_loaded <= BLOCK_SIZE
    counters = prefill.all_counters()
    assert counters["kv_store_hit_tokens"][1] == num_loaded
    assert counters["store_loaded_prompt_tokens"][1] == num_loaded
    await stored.assert_whole()


async def test_corrupt_stored_entries_are_misses_and_recomputed(
    demo_model_dir: Path, reference: Reference, tmp_path: Path
) -> None:
    root = tmp_path / "kv"
    cluster = await _cluster(demo_model_dir, f"file:{root}")
    try:
        ids = await _stream(cluster, PROMPT, PREEMPT_AFTER)
        assert ids == await _expected(reference)
        entries = sorted(root.rglob("*.kv"))
        assert entries
        for entry in entries:  # one flipped payload byte per entry: its CRC no longer holds
            data = bytearray(entry.read_bytes())
            data[HEADER_NBYTES + 7] ^= 0xFF
            entry.write_bytes(bytes(data))
        prefill = cluster.prefills[0]
        computed_before = prefill.loop.num_prompt_tokens
        loaded_before = prefill.loop.scheduler.num_loaded_prompt_tokens
        ids = await _stream(cluster, PROMPT, None)
        assert ids == await _expected(reference)
        num_prompt = len(reference.tokenizer.encode(PROMPT))
        assert prefill.loop.num_prompt_tokens - computed_before == num_prompt
        assert prefill.loop.scheduler.num_loaded_prompt_tokens == loaded_before
        assert prefill.all_counters()["kv_store_miss_blocks_corrupt"][1] >= 1
        await cluster.assert_whole()
    finally:
        await cluster.close()


async def test_store_down_offload_falls_back_without_losing_tokens(
    demo_model_dir: Path, reference: Reference, redis_server: RedisServer
) -> None:
    cluster = await _cluster(demo_model_dir, redis_server.spec + "?timeout_s=0.2")
    try:
        redis_server.stop()
        ids = await _stream(cluster, PROMPT, PREEMPT_AFTER)
        assert ids == await _expected(reference)
        decode, prefill = cluster.decodes[0], cluster.prefills[0]
        assert decode.offload is not None
        assert (decode.offload.num_written, decode.offload.num_skipped) == (0, 1)
        assert decode.all_counters()["kv_store_errors"][1] >= 1
        assert prefill.all_counters()["kv_store_errors"][1] >= 1
        assert prefill.loop.scheduler.num_loaded_prompt_tokens == 0
        await cluster.assert_whole()
    finally:
        await cluster.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a store behind a partition)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


async def test_a_store_that_never_answers_costs_no_lease(
    demo_model_dir: Path, reference: Reference, silent_port: int
) -> None:
    """A store cut off (connections hang, nothing is refused) is waited on by the first lookup
    only, before its lease: no lease expires, though the wait is longer than their TTL; the
    prompts after it skip the store; every answer equals the engine's."""
    cluster = await _cluster(
        demo_model_dir,
        f"redis://127.0.0.1:{silent_port}?timeout_s=1",
        decode_overrides=[{"lease_ttl_ms": 1500}],
    )
    try:
        prefill, decode = cluster.prefills[0], cluster.decodes[0]
        first = await _stream(cluster, PROMPT, None)
        assert first == await _expected(reference)
        assert prefill.kv_store is not None and not prefill.kv_store.is_reachable
        started = time.monotonic()
        again = await asyncio.gather(*(_stream(cluster, PROMPT, None) for _ in range(3)))
        assert again == [first] * 3
        assert time.monotonic() - started < 10  # NOTE: no request waited on the store
        assert decode.all_counters()["lease_expiries"][1] == 0
        counters = prefill.all_counters()
        assert counters["kv_store_unreachable"][1] == 1
        assert counters["kv_store_lookups_skipped"][1] == 3
        await cluster.assert_whole()
    finally:
        await cluster.close()


async def test_without_a_store_the_reschedule_recomputes_everything(
    demo_model_dir: Path, reference: Reference
) -> None:
    cluster = await _cluster(demo_model_dir, None)
    try:
        ids = await _stream(cluster, PROMPT, PREEMPT_AFTER)
        assert ids == await _expected(reference)
        prefill = cluster.prefills[0]
        num_prompt = len(reference.tokenizer.encode(PROMPT))
        # The prompt, then prompt and generated tokens again: nothing reused.
        assert prefill.loop.num_prompt_tokens >= 2 * num_prompt + PREEMPT_AFTER
        assert "kv_store_errors" not in prefill.all_counters()
        await cluster.assert_whole()
    finally:
        await cluster.close()
