"""The cuda_ipc transport between a real prefill and a real decode, with the CPU stand-in for
the CUDA IPC handle: preference, fallback, and the commit rules it shares with shared memory."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest
import structlog
from support.eventually import eventually
from support.prefill_cluster import Cluster, cluster

from pdserve.common import errors
from pdserve.common.env import ENV_KV_IPC_STANDIN
from pdserve.common.errors import ErrorReason
from pdserve.common.generation import SamplingParams
from pdserve.engine.colocated import LLMEngine
from pdserve.engine.kv_cache import KVCache
from pdserve.kv.transfer import layer_pieces
from pdserve.kv.transports.cuda_ipc_window import MappedCaches
from pdserve.kv.transports.offer import TransportOffer
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.convert import lease_from_proto
from pdserve.v1 import decode_pb2

LONG = [(13 * i + 5) % 310 + 3 for i in range(53)]
SHORT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# NOTE: the decodes here do not offer NIXL, which the default prefers over all of these
# (tests/integration/prefill/test_kv_nixl.py).
WITHOUT_NIXL = {"kv_transports": "cuda_ipc,shm,tcp"}


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_KV_IPC_STANDIN, "1")


async def _transport_of(pd: Cluster, request_id: str, prompt: list[int]) -> str:
    events = await pd.run_prefill(pd.request(request_id, prompt, GREEDY))
    assert events.error is None, events.error
    handed_off = events.last("handed_off").handed_off
    await pd.decode_stubs[0].ReleaseLease(
        decode_pb2.ReleaseLeaseRequest(lease_id=handed_off.lease_id, request_id=request_id)
    )
    return str(handed_off.transport)


@pytest.mark.usefixtures("standin")
async def test_the_default_prefers_cuda_ipc_where_offered_and_the_output_is_the_engines(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    async with cluster(
        tiny_model_dir, kv_transports=PrefillConfig.kv_transports, decode_overrides=WITHOUT_NIXL
    ) as pd:
        offers = [o.kind for o in pd.decodes[0].servicer.transport_offers]
        assert offers == ["cuda_ipc", "shm", "tcp"]
        prompts = (LONG, SHORT, LONG[::-1])
        results = await asyncio.gather(
            *(pd.complete(f"r{i}", p, GREEDY) for i, p in enumerate(prompts))
        )
        assert results == [engine.generate([p], GREEDY)[0] for p in prompts]
        assert await _transport_of(pd, "one-more", SHORT) == "TRANSPORT_KIND_CUDA_IPC"
        assert len(pd.prefill.handoffs.transfers.mapped_caches) == 1  # mapped once
        await pd.eventually_whole()


async def test_a_cpu_decode_does_not_offer_cuda_ipc_without_the_standin(
    tiny_model_dir: Path,
) -> None:
    async with cluster(
        tiny_model_dir, kv_transports=PrefillConfig.kv_transports, decode_overrides=WITHOUT_NIXL
    ) as pd:
        assert [o.kind for o in pd.decodes[0].servicer.transport_offers] == ["shm", "tcp"]
        assert await _transport_of(pd, "r", SHORT) == "TRANSPORT_KIND_SHARED_MEMORY"


@pytest.mark.usefixtures("standin")
async def test_a_handle_that_cannot_be_opened_falls_back_with_one_log_line(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    async with cluster(
        tiny_model_dir, kv_transports=PrefillConfig.kv_transports, decode_overrides=WITHOUT_NIXL
    ) as pd:
        decode = pd.decodes[0]
        ipc, *others = decode.servicer.transport_offers
        assert ipc.handle is not None
        broken = dataclasses.replace(ipc.handle, memory_handle=b"pdserve-kv-1-gone")
        decode.servicer.transport_offers = (TransportOffer("cuda_ipc", "", broken), *others)
        with structlog.testing.capture_logs() as logs:
            assert await pd.complete("r", LONG, GREEDY) == engine.generate([LONG], GREEDY)[0]
        fallbacks = [e for e in logs if e["event"] == "kv_transport_fallback"]
        assert [e["transport"] for e in fallbacks] == ["cuda_ipc"]
        assert await _transport_of(pd, "r2", SHORT) == "TRANSPORT_KIND_SHARED_MEMORY"
        await pd.eventually_whole()


@pytest.mark.usefixtures("standin")
async def test_a_handle_of_another_host_is_not_tried(tiny_model_dir: Path) -> None:
    async with cluster(
        tiny_model_dir, kv_transports=PrefillConfig.kv_transports, decode_overrides=WITHOUT_NIXL
    ) as pd:
        decode = pd.decodes[0]
        ipc, *others = decode.servicer.transport_offers
        assert ipc.handle is not None
        elsewhere = dataclasses.replace(ipc.handle, host_id="another-host")
        decode.servicer.transport_offers = (TransportOffer("cuda_ipc", "", elsewhere), *others)
        with structlog.testing.capture_logs() as logs:
            assert await _transport_of(pd, "r", SHORT) == "TRANSPORT_KIND_SHARED_MEMORY"
        assert not [e for e in logs if e["event"] == "kv_transport_fallback"]


@pytest.mark.usefixtures("standin")
async def test_corrupt_kv_over_cuda_ipc_is_refused_and_the_blocks_return(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_FAULT_CORRUPT_KV", "bad-*")
    async with cluster(tiny_model_dir, kv_transports="cuda_ipc") as pd:
        events = await pd.run_prefill(pd.request("bad-1", LONG, GREEDY))
        assert events.error is not None
        assert events.error.reason is ErrorReason.CACHE_SYNC_FAILED
        await pd.eventually_whole()


# ---- a transfer that stops mid-copy ----------------------------------------------------------


async def _copy_first_layer(pd: Cluster, lease: decode_pb2.Lease) -> grpc.aio.StreamUnaryCall:
    """Opens a cuda_ipc SyncCache for `lease` and copies its first layer into the decode's
    cache through the advertised handle, as a prefill does; the rest never comes."""
    grant = lease_from_proto(lease)
    (offer,) = [o for o in grant.transports if o.kind == "cuda_ipc"]
    assert offer.handle is not None
    source: KVCache = pd.prefill.host.runner.kv_cache
    caches = MappedCaches(source)
    source_ids = list(range(len(lease.block_ids)))
    window = caches.open(offer.handle).window(lease.block_ids, 0, source)
    call = pd.decode_stubs[0].SyncCache()
    await call.write(
        decode_pb2.SyncCacheRequest(
            header=decode_pb2.SyncCacheHeader(
                lease_id=lease.lease_id,
                request_id="r",
                token_ids=list(range(1, 9)),
                transport_token=grant.transport_token,
                transport=decode_pb2.TRANSPORT_KIND_CUDA_IPC,
            )
        )
    )
    assert dict(await call.initial_metadata()).get("pdserve-sync-accepted") == "1"
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


@pytest.mark.usefixtures("standin")
async def test_a_lease_expiring_mid_copy_commits_nothing_and_returns_every_block(
    tiny_model_dir: Path,
) -> None:
    async with cluster(tiny_model_dir, decode_overrides={"lease_ttl_ms": 300}) as pd:
        decode = pd.decodes[0]
        lease = await pd.allocate(8)
        call = await _copy_first_layer(pd, lease)
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


@pytest.mark.usefixtures("standin")
async def test_a_sender_gone_mid_copy_fails_the_lease_and_returns_every_block(
    tiny_model_dir: Path,
) -> None:
    async with cluster(tiny_model_dir) as pd:
        decode = pd.decodes[0]
        lease = await pd.allocate(8)
        call = await _copy_first_layer(pd, lease)
        (held,) = decode.leases.table.open_leases()
        call.cancel()  # the sender died between two layers
        await eventually(lambda: held.status.name == "FAILED", 30, "the lease to fail")
        # Held a little longer: copies the sender queued on its GPU may still land.
        assert decode.leases.table.pool.num_used_blocks == len(lease.block_ids)
        await pd.eventually_whole()
        decode.leases.table.pool.check_integrity()
