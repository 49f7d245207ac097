"""The engine thread: KV leaves layer by layer during the pass, every block exactly once, and
the sender writes the stream the benchmarks and the decode tests send."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from support.prefill_cluster import BLOCK_SIZE, load_host

from pdserve.common.generation import SamplingParams, num_blocks_for
from pdserve.engine.batch import ScheduledChunk
from pdserve.kv.transfer import KvPiece
from pdserve.prefill.events import EngineEvent, FirstTokenSampled, LeaseGrant
from pdserve.prefill.kv.channels import GrpcChannel
from pdserve.prefill.kv.sender import KvSender, sync_cache_messages
from pdserve.prefill.prefill_loop import PrefillLoop
from pdserve.prefill.request import Request
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import decode_pb2

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(37)]  # 10 blocks, the last one partial


class _Recorder:
    """Collects engine events and marks where each forward pass returned."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.done = threading.Event()

    def sink(self, event: EngineEvent) -> None:
        self.events.append(event)
        if isinstance(event, FirstTokenSampled):
            self.done.set()


@pytest.fixture(scope="module")
def host(tiny_model_dir: Path) -> ModelHost:
    return load_host(tiny_model_dir, num_blocks=32)


def _loop(
    host: ModelHost,
    recorder: _Recorder,
    budget: int,
    chunk_bytes: int,
    *,
    enable_prefix_cache: bool = False,
) -> PrefillLoop:
    loop = PrefillLoop(
        host.runner,
        budget,
        chunk_bytes,
        enable_prefix_cache=enable_prefix_cache,
        kv_fingerprint=host.kv_layout.fingerprint,
    )
    execute = host.runner.execute

    def marked_execute(chunks: Sequence[ScheduledChunk], on_layer_done=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        logits = execute(chunks, on_layer_done)
        recorder.events.append("pass_returned")
        return logits

    loop.runner = type("MarkedRunner", (), {})()  # a stand-in with the runner's interface
    loop.runner.execute = marked_execute  # type: ignore[attr-defined]
    loop.runner.kv_cache = host.runner.kv_cache  # type: ignore[attr-defined]
    return loop


def _request(recorder: _Recorder, token_ids: Sequence[int] = PROMPT) -> Request:
    return Request(
        request_id="r",
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        sampling=SamplingParams(temperature=0.0),
        seed=0,
        decode_address="127.0.0.1:1",
        sink=recorder.sink,
    )


def _release(loop: PrefillLoop, request: Request) -> None:
    """Releases `request` and waits until its blocks are free."""
    released = threading.Event()
    loop.release(request, released.set)
    assert released.wait(10)


def _run(
    host: ModelHost, budget: int, chunk_bytes: int
) -> tuple[list[object], Request, dict[tuple[int, int], bytes]]:
    recorder = _Recorder()
    loop = _loop(host, recorder, budget, chunk_bytes)
    request = _request(recorder)
    loop.start()
    try:
        loop.submit(request)
        assert recorder.done.wait(30)
        block_ids = list(request.block_ids)
        expected = {
            (layer, b): bytes(host.runner.kv_cache.export_blocks(layer, [block_ids[b]]).k)
            for layer in range(host.runner.kv_cache.layout.num_layers)
            for b in range(len(block_ids))
        }
        _release(loop, request)
        assert loop.scheduler.pool.num_free_blocks == loop.scheduler.pool.num_blocks
    finally:
        loop.stop()
    return recorder.events, request, expected


def test_kv_leaves_layer_by_layer_while_the_pass_runs(host: ModelHost) -> None:
    events, _, _ = _run(host, budget=64, chunk_bytes=1 << 20)
    pieces = [e for e in events if isinstance(e, KvPiece)]
    # One pass: every layer's piece is handed over before the pass returns, in layer order.
    assert events.index("pass_returned") > max(events.index(p) for p in pieces)
    assert [p.layer_index for p in pieces] == list(range(host.runner.kv_cache.layout.num_layers))
    assert isinstance(events[-1], FirstTokenSampled)


def test_chunked_prompt_ships_every_block_of_every_layer_exactly_once(host: ModelHost) -> None:
    # Budget 16 with block size 4: passes of 16, 16 and 5 tokens; max 2 blocks per piece.
    chunk_bytes = 2 * 2 * host.runner.kv_cache.layout.block_nbytes
    events, request, expected = _run(host, budget=16, chunk_bytes=chunk_bytes)
    pieces = [e for e in events if isinstance(e, KvPiece)]
    seen: dict[tuple[int, int], bytes] = {}
    for piece in pieces:
        assert piece.num_blocks <= 2
        size = len(piece.key) // piece.num_blocks
        for i in range(piece.num_blocks):
            key = (piece.layer_index, piece.first_block + i)
            assert key not in seen, f"block shipped twice: {key}"
            seen[key] = bytes(piece.key[i * size : (i + 1) * size])
    assert seen == expected
    assert events.count("pass_returned") == 3
    # The first pass already shipped its 4 full blocks of layer 0 before the second pass ran.
    first_return = events.index("pass_returned")
    assert any(isinstance(e, KvPiece) for e in events[:first_return])
    assert request.num_sent_blocks == num_blocks_for(len(PROMPT), BLOCK_SIZE)


def _shipped_blocks(pieces: list[KvPiece]) -> dict[tuple[int, int], bytes]:
    """The K bytes of every (layer, logical block) the pieces carry; each at most once."""
    seen: dict[tuple[int, int], bytes] = {}
    for piece in pieces:
        size = len(piece.key) // piece.num_blocks
        for i in range(piece.num_blocks):
            key = (piece.layer_index, piece.first_block + i)
            assert key not in seen, f"block shipped twice: {key}"
            seen[key] = bytes(piece.key[i * size : (i + 1) * size])
    return seen


def test_cached_leading_blocks_are_shipped_with_the_first_pass(host: ModelHost) -> None:
    # The second prompt shares 6 of PROMPT's blocks; budget 8: it computes 13 tokens in passes
    # of 8 and 5, and its first pass ships the 6 cached blocks (never computed) with its own.
    second = [*PROMPT[:24], *range(40, 53)]
    recorder = _Recorder()
    loop = _loop(host, recorder, budget=8, chunk_bytes=1 << 20, enable_prefix_cache=True)
    loop.start()
    try:
        for token_ids in (PROMPT, second):
            recorder.events.clear()
            recorder.done.clear()
            request = _request(recorder, token_ids)
            loop.submit(request)
            assert recorder.done.wait(30)
            block_ids = list(request.block_ids)
            expected = {
                (layer, b): bytes(host.runner.kv_cache.export_blocks(layer, [block_ids[b]]).k)
                for layer in range(host.runner.kv_cache.layout.num_layers)
                for b in range(len(block_ids))
            }
            _release(loop, request)
        pieces = [e for e in recorder.events if isinstance(e, KvPiece)]
        assert _shipped_blocks(pieces) == expected
        first_return = recorder.events.index("pass_returned")
        first_pass = [e for e in recorder.events[:first_return] if isinstance(e, KvPiece)]
        assert {(p.first_block, p.num_blocks) for p in first_pass} == {(0, 8)}
        assert recorder.events.count("pass_returned") == 2
        assert request.num_cached_tokens == 24
        loop.scheduler.check_integrity()
    finally:
        loop.stop()


def test_an_idle_loop_hands_back_the_pages_of_its_free_blocks_but_not_of_its_prefixes(
    host: ModelHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed_back: list[list[int]] = []
    done = threading.Event()

    def release_pages(block_ids: Sequence[int]) -> int:
        handed_back.append(list(block_ids))
        if block_ids:
            done.set()
        return 0

    monkeypatch.setattr(host.runner.kv_cache, "release_pages", release_pages)
    recorder = _Recorder()
    loop = _loop(host, recorder, budget=64, chunk_bytes=1 << 20, enable_prefix_cache=True)
    loop._idle_trim_s = 0.01  # an idle spell of 10 ms instead of the services' 2 s
    request = _request(recorder)
    loop.start()
    try:
        loop.submit(request)
        assert recorder.done.wait(30)
        block_ids = list(request.block_ids)
        _release(loop, request)
        assert done.wait(30), "the loop went idle and handed nothing back"
        # PROMPT's 9 full blocks stay in the prefix cache; its partial last block goes.
        assert [ids for ids in handed_back if ids] == [[block_ids[-1]]]
        pool = loop.scheduler.pool
        assert [pool.get_cached_block(key) for key in request.block_keys] == block_ids[:-1]
        loop.scheduler.check_integrity()
    finally:
        loop.stop()


class _RecordingCall:
    """A SyncCache call that keeps what is written and commits."""

    def __init__(self) -> None:
        self.messages: list[decode_pb2.SyncCacheRequest] = []

    async def write(self, message: decode_pb2.SyncCacheRequest) -> None:
        self.messages.append(message)

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> bool:
        return False

    def __await__(self) -> Any:
        return self._response().__await__()

    async def _response(self) -> decode_pb2.SyncCacheResponse:
        return decode_pb2.SyncCacheResponse(state=decode_pb2.LEASE_STATE_COMMITTED)


class _RecordingStub:
    def __init__(self) -> None:
        self.call = _RecordingCall()

    def SyncCache(self, metadata: Any = None) -> _RecordingCall:
        return self.call


async def test_one_pass_prompt_is_sent_as_sync_cache_messages_builds_it(host: ModelHost) -> None:
    # bench/kv_transfer.py and the decode tests send `sync_cache_messages`; a prompt computed in
    # one pass must reach the decode as exactly that stream. 3 blocks per chunk: the last of the
    # 10 blocks travels in a short chunk.
    chunk_bytes = 3 * 2 * host.runner.kv_cache.layout.block_nbytes
    recorder = _Recorder()
    loop = _loop(host, recorder, budget=64, chunk_bytes=chunk_bytes)
    request = _request(recorder)
    request.lease = LeaseGrant("lease-1", (), "decode-1", b"token")
    loop.start()
    try:
        loop.submit(request)
        assert recorder.done.wait(30)
        stub = _RecordingStub()
        sender = KvSender(request, [GrpcChannel(stub, request)])  # type: ignore[arg-type]
        for event in recorder.events:
            if isinstance(event, KvPiece):
                sender.put(event)
        first = recorder.events[-1]
        assert isinstance(first, FirstTokenSampled)
        sender.commit(first.token_id, request.first_token_index)
        await sender.run()
        expected = sync_cache_messages(request, host.runner.kv_cache, first.token_id, chunk_bytes)
        assert stub.call.messages == list(expected)
        assert [m.chunk.num_blocks for m in stub.call.messages[1:5]] == [3, 3, 3, 1]
        _release(loop, request)
    finally:
        loop.stop()


@pytest.mark.parametrize("release_after_return", [False, True])
def test_a_stop_frees_the_releases_queued_during_the_last_pass(
    host: ModelHost, release_after_return: bool
) -> None:
    # Budget 16: the 37-token prompt needs three passes, so it is running while the first one
    # computes and a release then waits for the pass boundary. A stop at that boundary (or a
    # release after the thread has returned) must still free the blocks and say so: a cleanup
    # waiting on it used to wait out its whole time.
    recorder = _Recorder()
    loop = _loop(host, recorder, budget=16, chunk_bytes=1 << 20)
    in_pass, go_on = threading.Event(), threading.Event()
    execute = loop.runner.execute

    def held_execute(chunks: Sequence[ScheduledChunk], on_layer_done=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        in_pass.set()
        assert go_on.wait(30)
        return execute(chunks, on_layer_done)

    loop.runner.execute = held_execute
    request = _request(recorder)
    released = threading.Event()
    loop.start()
    try:
        loop.submit(request)
        assert in_pass.wait(30)
        assert request in loop.scheduler.running
        if not release_after_return:
            loop.release(request, released.set)
            assert not released.is_set()  # queued for the pass boundary
        stopper = threading.Thread(target=loop.stop)
        stopper.start()
        deadline = time.monotonic() + 30
        while not loop._is_stopped:  # the stop is asked before the pass ends
            assert time.monotonic() < deadline
            time.sleep(0.001)
        go_on.set()
        stopper.join(30)
        assert not loop.is_running
        if release_after_return:
            assert request in loop.scheduler.running
            loop.release(request, released.set)
        assert released.wait(10)
        assert loop.scheduler.pool.num_free_blocks == loop.scheduler.pool.num_blocks
    finally:
        go_on.set()
        loop.stop()
