"""The nixl transport between a real prefill and a real decode (one-sided NIXL WRITEs over UCX
into the decode's registered cache): exact output, preference, fallback without NIXL, and the
commit rules it shares with shared memory (a corrupt block, a lease that expires mid-write, a
sender gone or SIGKILLed mid-write: nothing commits, every block returns)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import grpc
import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.eventually import eventually
from support.prefill_cluster import Cluster, cluster

from pdserve.common import errors
from pdserve.common.errors import ErrorReason
from pdserve.common.generation import SamplingParams
from pdserve.engine.colocated import LLMEngine
from pdserve.kv.transfer import layer_pieces
from pdserve.kv.transports import nixl
from pdserve.kv.transports.nixl_window import NixlWindow
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.convert import lease_from_proto
from pdserve.prefill.kv import transfers as kv_transfers
from pdserve.v1 import decode_pb2

try:
    nixl.load_api()
except nixl.NixlUnavailable as missing:
    pytest.skip(f"{missing}", allow_module_level=True)

LONG = [(13 * i + 5) % 310 + 3 for i in range(53)]
SHORT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
WRITER = Path(__file__).parents[2] / "support" / "nixl_writer.py"


async def _transport_of(pd: Cluster, request_id: str, prompt: list[int]) -> str:
    events = await pd.run_prefill(pd.request(request_id, prompt, GREEDY))
    assert events.error is None, events.error
    handed_off = events.last("handed_off").handed_off
    await pd.decode_stubs[0].ReleaseLease(
        decode_pb2.ReleaseLeaseRequest(lease_id=handed_off.lease_id, request_id=request_id)
    )
    return str(handed_off.transport)


async def test_forced_nixl_carries_the_kv_and_the_output_is_the_engines(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    async with cluster(tiny_model_dir, kv_transports="nixl") as pd:
        prompts = (LONG, SHORT, LONG[::-1])
        references = [engine.generate([p], GREEDY)[0] for p in prompts]
        results = await asyncio.gather(
            *(pd.complete(f"r{i}", p, GREEDY) for i, p in enumerate(prompts))
        )
        assert results == references
        assert await _transport_of(pd, "one-more", SHORT) == "TRANSPORT_KIND_NIXL"
        await pd.eventually_whole()


async def test_nixl_first_where_both_ends_have_it_and_the_span_says_why(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(kv_transfers, "_tracer", provider.get_tracer("pdserve.prefill"))
    # NOTE: the default puts the copies within one host first (shm is faster here); NIXL
    # first is one flag away.
    async with cluster(tiny_model_dir, kv_transports=PrefillConfig.kv_transports) as pd:
        assert await _transport_of(pd, "default", SHORT) == "TRANSPORT_KIND_SHARED_MEMORY"
    exporter.clear()
    async with cluster(tiny_model_dir, kv_transports="nixl,shm,tcp,grpc") as pd:
        with structlog.testing.capture_logs() as logs:
            assert await _transport_of(pd, "r", SHORT) == "TRANSPORT_KIND_NIXL"
        assert not [e for e in logs if e["event"] == "kv_transport_fallback"]
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "prefill.kv_transfer"]
    attributes = dict(span.attributes or {})
    assert attributes["pdserve.transport"] == "nixl"
    assert str(attributes["pdserve.transport.reason"]).startswith("first of nixl, shm, tcp")
    assert int(attributes["pdserve.kv.num_bytes"]) > 0
    assert float(attributes["pdserve.kv.seconds"]) > 0
    provider.shutdown()


async def test_without_nixl_the_default_falls_back_to_shared_memory_with_one_line_each(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, engine: LLMEngine
) -> None:
    monkeypatch.setattr(nixl, "_MODULES", ("pdserve_no_such_nixl._api",))
    with structlog.testing.capture_logs() as logs:
        async with cluster(tiny_model_dir, kv_transports=PrefillConfig.kv_transports) as pd:
            assert not [o for o in pd.decodes[0].servicer.transport_offers if o.kind == "nixl"]
            assert await pd.complete("r", LONG, GREEDY) == engine.generate([LONG], GREEDY)[0]
            assert await _transport_of(pd, "r2", SHORT) == "TRANSPORT_KIND_SHARED_MEMORY"
            await eventually(
                lambda: len([e for e in logs if e.get("transport") == "nixl"]) == 2,
                5,
                "the prefill's line",
            )
    unavailable = [e for e in logs if e.get("transport") == "nixl"]
    assert [e["event"] for e in unavailable] == ["kv_transport_unavailable"] * 2  # one per end
    assert "not installed" in unavailable[0]["detail"]


async def test_corrupt_kv_over_nixl_is_refused_and_the_blocks_return(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_FAULT_CORRUPT_KV", "bad-*")
    async with cluster(tiny_model_dir, kv_transports="nixl") as pd:
        events = await pd.run_prefill(pd.request("bad-1", LONG, GREEDY))
        assert events.error is not None
        assert events.error.reason is ErrorReason.CACHE_SYNC_FAILED
        await pd.eventually_whole()
        pd.decodes[0].leases.table.pool.check_integrity()


# ---- a transfer that stops mid-write ---------------------------------------------------------


async def _lease(pd: Cluster, num_tokens: int) -> decode_pb2.Lease:
    """A lease of `num_tokens`, granted once the prefill's agent started (a short TTL runs
    from the grant)."""
    side = pd.prefill.handoffs.transfers.nixl
    assert side is not None
    await side.peers()
    return await pd.allocate(num_tokens)


async def _write_first_layer(pd: Cluster, lease: decode_pb2.Lease) -> grpc.aio.StreamUnaryCall:
    """Opens a nixl SyncCache for `lease` and WRITEs its first layer into the decode's cache
    with the prefill's agent, as a prefill does; the rest never comes."""
    grant = lease_from_proto(lease)
    (offer,) = [o for o in grant.transports if o.kind == "nixl"]
    assert offer.nixl is not None and len(offer.nixl.block_addresses) == len(lease.block_ids)
    side = pd.prefill.handoffs.transfers.nixl
    assert side is not None
    window = NixlWindow(await side.peers(), offer.nixl)
    source = pd.prefill.host.runner.kv_cache
    call = pd.decode_stubs[0].SyncCache()
    await call.write(
        decode_pb2.SyncCacheRequest(
            header=decode_pb2.SyncCacheHeader(
                lease_id=lease.lease_id,
                request_id="r",
                token_ids=list(range(1, 9)),
                transport_token=grant.transport_token,
                transport=decode_pb2.TRANSPORT_KIND_NIXL,
            )
        )
    )
    assert dict(await call.initial_metadata()).get("pdserve-sync-accepted") == "1"
    source_ids = list(range(len(lease.block_ids)))
    for piece in layer_pieces(source, 0, source_ids, len(source_ids)):
        crc = window.write(piece)
        window.wait()
        await call.write(
            decode_pb2.SyncCacheRequest(
                chunk=decode_pb2.KvChunk(
                    layer_index=piece.layer_index,
                    first_block=piece.first_block,
                    num_blocks=piece.num_blocks,
                    crc32c=crc,
                )
            )
        )
    return call


async def test_a_lease_expiring_mid_write_commits_nothing_and_returns_every_block(
    tiny_model_dir: Path,
) -> None:
    async with cluster(
        tiny_model_dir, kv_transports="nixl", decode_overrides={"lease_ttl_ms": 300}
    ) as pd:
        decode = pd.decodes[0]
        lease = await _lease(pd, 8)
        call = await _write_first_layer(pd, lease)
        (held,) = decode.leases.table.open_leases()
        await eventually(lambda: held.status.name == "EXPIRED", 30, "the lease to expire")
        # Ended, yet held while its writer may still write.
        assert decode.leases.table.pool.num_used_blocks == len(lease.block_ids)
        await call.write(decode_pb2.SyncCacheRequest(commit=decode_pb2.SyncCacheCommit()))
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert errors.from_rpc_error(raised.value).reason is ErrorReason.LEASE_EXPIRED
        assert held.status.name == "EXPIRED"
        await pd.eventually_whole()


async def test_a_sender_gone_mid_write_fails_the_lease_and_returns_every_block(
    tiny_model_dir: Path,
) -> None:
    async with cluster(tiny_model_dir, kv_transports="nixl") as pd:
        decode = pd.decodes[0]
        lease = await _lease(pd, 8)
        call = await _write_first_layer(pd, lease)
        (held,) = decode.leases.table.open_leases()
        call.cancel()  # the sender died between two layers
        await eventually(lambda: held.status.name == "FAILED", 30, "the lease to fail")
        # Held a little longer: WRITEs the sender posted may still be on the wire.
        assert decode.leases.table.pool.num_used_blocks == len(lease.block_ids)
        await pd.eventually_whole()
        decode.leases.table.pool.check_integrity()


async def _line(stream: asyncio.StreamReader, wanted: bytes) -> None:
    """Reads `stream` up to the line `wanted` (NIXL logs to stdout too)."""
    while (line := await stream.readline()) != wanted:
        assert line, f"the writer ended before {wanted!r}"


async def _ask(writer: asyncio.subprocess.Process, command: str, answer: str) -> None:
    """Sends `command` to a `support/nixl_writer.py` process and waits for `answer`."""
    assert writer.stdin is not None and writer.stdout is not None
    writer.stdin.write(command.encode() + b"\n")
    await writer.stdin.drain()
    await asyncio.wait_for(_line(writer.stdout, answer.encode() + b"\n"), 30)


async def test_a_sender_sigkilled_mid_write_fails_the_lease_and_returns_every_block(
    tiny_model_dir: Path,
) -> None:
    async with cluster(tiny_model_dir, kv_transports="nixl") as pd:
        decode = pd.decodes[0]
        layout = decode.host.runner.kv_cache.layout
        writer = await asyncio.create_subprocess_exec(
            sys.executable, str(WRITER), decode.address, str(layout.num_layers),
            str(layout.num_kv_heads), str(layout.head_dim), str(layout.block_size),
            layout.dtype, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert writer.stdout is not None
        try:
            await asyncio.wait_for(_line(writer.stdout, b"ready\n"), 60)
            lease = await _lease(pd, 8)
            await _ask(writer, f"lease {lease.SerializeToString().hex()}", "open")
            # One layer written and announced, the next one's WRITEs posted: then the kill.
            await _ask(writer, "layer 0", "done 0")
            await _ask(writer, "post 1", "posted 1")
            (held,) = decode.leases.table.open_leases()
            assert held.status.name == "SYNCING"
            writer.send_signal(signal.SIGKILL)
            assert await writer.wait() == -signal.SIGKILL
        finally:
            if writer.returncode is None:
                writer.kill()
                await writer.wait()
        await eventually(lambda: held.status.name == "FAILED", 30, "the lease to fail")
        await pd.eventually_whole()
        decode.leases.table.pool.check_integrity()
