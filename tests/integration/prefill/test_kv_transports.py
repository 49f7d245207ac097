"""The KV transports between a real prefill and a real decode: each one forced, fallback, and
the refusals of the TCP data port and the shared-memory window."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import pytest
from support.eventually import eventually
from support.prefill_cluster import Cluster, cluster

from pdserve.common import errors
from pdserve.common.errors import ErrorReason
from pdserve.common.generation import SamplingParams
from pdserve.decode.kv import transfers
from pdserve.decode.kv.receiver import KvReceiver
from pdserve.decode.request import DecodeRequest
from pdserve.engine.colocated import LLMEngine
from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.staging import HostStaging
from pdserve.kv.transfer import KvPiece, chunk_crc32c
from pdserve.kv.transports.offer import TransportOffer
from pdserve.kv.transports.shm import LeaseWindow, SharedKvPool
from pdserve.kv.transports.tcp import frame, recv_frame
from pdserve.prefill.config import PrefillConfig
from pdserve.v1 import decode_pb2, errors_pb2

LONG = [(13 * i + 5) % 310 + 3 for i in range(53)]
SHORT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
KINDS = {
    "shm": decode_pb2.TRANSPORT_KIND_SHARED_MEMORY,
    "tcp": decode_pb2.TRANSPORT_KIND_TCP,
    "grpc": decode_pb2.TRANSPORT_KIND_GRPC_SYNC_CACHE,
}


async def _handed_off(pd: Cluster, request_id: str, prompt: list[int]) -> decode_pb2.Lease:
    events = await pd.run_prefill(pd.request(request_id, prompt, GREEDY))
    assert events.error is None, events.error
    return events.last("handed_off").handed_off


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
async def test_a_forced_transport_carries_the_kv_and_the_output_is_the_engines(
    tiny_model_dir: Path, engine: LLMEngine, transport: str
) -> None:
    async with cluster(tiny_model_dir, kv_transports=transport) as pd:
        references = [engine.generate([p], GREEDY)[0] for p in (LONG, SHORT, LONG[::-1])]
        results = await asyncio.gather(
            *(pd.complete(f"r{i}", p, GREEDY) for i, p in enumerate((LONG, SHORT, LONG[::-1])))
        )
        assert results == references
        handed_off = await _handed_off(pd, "one-more", SHORT)
        assert handed_off.transport == decode_pb2.TransportKind.Name(KINDS[transport])
        await pd.decode_stubs[0].ReleaseLease(
            decode_pb2.ReleaseLeaseRequest(lease_id=handed_off.lease_id, request_id="one-more")
        )
        await pd.eventually_whole()


async def test_without_nixl_the_default_prefers_shared_memory_on_one_host(
    tiny_model_dir: Path,
) -> None:
    async with cluster(
        tiny_model_dir,
        kv_transports=PrefillConfig.kv_transports,
        decode_overrides={"kv_transports": "cuda_ipc,shm,tcp"},
    ) as pd:
        handed_off = await _handed_off(pd, "r", SHORT)
        assert handed_off.transport == "TRANSPORT_KIND_SHARED_MEMORY"


async def test_a_segment_this_host_lacks_falls_back_to_tcp_without_failing(
    tiny_model_dir: Path, engine: LLMEngine
) -> None:
    async with cluster(tiny_model_dir, kv_transports=PrefillConfig.kv_transports) as pd:
        # The decode "on another host": its segment name resolves to nothing here.
        decode = pd.decodes[0]
        tcp = next(o for o in decode.servicer.transport_offers if o.kind == "tcp")
        decode.servicer.transport_offers = (
            TransportOffer("shm", "pdserve-kv-1-00000000000000000000000000000000"),
            tcp,
        )
        assert await pd.complete("r", LONG, GREEDY) == engine.generate([LONG], GREEDY)[0]
        handed_off = await _handed_off(pd, "r2", SHORT)
        assert handed_off.transport == "TRANSPORT_KIND_TCP"


async def test_a_decode_without_offers_is_refused_when_tcp_is_forced(
    tiny_model_dir: Path,
) -> None:
    async with cluster(
        tiny_model_dir, kv_transports="tcp", decode_overrides={"kv_transports": ""}
    ) as pd:
        events = await pd.run_prefill(pd.request("r", SHORT, GREEDY))
        assert events.error is not None
        assert events.error.reason is ErrorReason.INCOMPATIBLE_PEER
        await pd.eventually_whole()


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
async def test_corrupt_kv_is_detected_on_every_transport(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    monkeypatch.setenv("PDSERVE_FAULT_CORRUPT_KV", "bad-*")
    async with cluster(tiny_model_dir, kv_transports=transport) as pd:
        events = await pd.run_prefill(pd.request("bad-1", LONG, GREEDY))
        assert events.error is not None
        assert events.error.reason is ErrorReason.CACHE_SYNC_FAILED
        await pd.eventually_whole()


# ---- the TCP data port, spoken to directly --------------------------------------------------


def _tcp_address(lease: decode_pb2.Lease) -> tuple[str, int]:
    offer = next(t for t in lease.transports if t.kind == decode_pb2.TRANSPORT_KIND_TCP)
    host, port = offer.address.rsplit(":", 1)
    return host, int(port)


def _header(lease: decode_pb2.Lease, request_id: str, num_tokens: int, token: bytes) -> bytes:
    header = decode_pb2.SyncCacheRequest(
        header=decode_pb2.SyncCacheHeader(
            lease_id=lease.lease_id,
            request_id=request_id,
            token_ids=list(range(1, num_tokens + 1)),
            transport_token=token,
            transport=decode_pb2.TRANSPORT_KIND_TCP,
        )
    )
    return frame(header.SerializeToString())


def _closed_without_answer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


async def test_a_wrong_token_on_the_data_port_is_closed_at_once_and_counted(
    tiny_model_dir: Path,
) -> None:
    async with cluster(tiny_model_dir) as pd:
        lease = await pd.allocate(8)
        decode = pd.decodes[0]
        with socket.create_connection(_tcp_address(lease)) as sock:
            sock.sendall(_header(lease, "r", 8, b"x" * 32))
            assert await asyncio.to_thread(_closed_without_answer, sock)
        assert decode.kv_tcp is not None and decode.kv_tcp.num_refused == 1
        (granted,) = decode.leases.table.open_leases()
        assert granted.status.name == "ALLOCATED"  # untouched: the right holder can still use it
        token = lease.transports[0].token
        with socket.create_connection(_tcp_address(lease)) as holder:
            holder.sendall(_header(lease, "r", 8, token))
            await eventually(lambda: granted.status.name == "SYNCING", 30, "the transfer to start")
            # The same token again while its transfer runs: used.
            with socket.create_connection(_tcp_address(lease)) as sock:
                sock.sendall(_header(lease, "r", 8, token))
                assert await asyncio.to_thread(_closed_without_answer, sock)
        assert decode.kv_tcp.num_refused == 2
        await pd.eventually_whole()


async def test_a_chunk_outside_the_lease_is_refused_and_the_lease_freed(
    tiny_model_dir: Path,
) -> None:
    async with cluster(tiny_model_dir) as pd:
        lease = await pd.allocate(8)  # 2 blocks of 4 tokens
        token = lease.transports[0].token
        block_nbytes = pd.decodes[0].host.runner.kv_cache.layout.block_nbytes
        chunk = decode_pb2.SyncCacheRequest(
            chunk=decode_pb2.KvChunk(layer_index=0, first_block=2, num_blocks=1, crc32c=0)
        )
        with socket.create_connection(_tcp_address(lease)) as sock:
            sock.sendall(_header(lease, "r", 8, token))
            sock.sendall(frame(chunk.SerializeToString()) + bytes(2 * block_nbytes))
            sock.settimeout(5)
            answer = decode_pb2.KvTcpResult.FromString(
                await asyncio.to_thread(recv_frame, sock, 1 << 16)
            )
        assert answer.error_reason == errors_pb2.ERROR_REASON_CACHE_SYNC_FAILED
        assert "outside the lease" in answer.error_message
        await pd.eventually_whole()


async def test_a_window_cannot_address_blocks_outside_its_lease(tiny_model_dir: Path) -> None:
    async with cluster(tiny_model_dir) as pd:
        lease = await pd.allocate(8)
        decode = pd.decodes[0]
        assert decode.kv_segment is not None
        layout = decode.host.runner.kv_cache.layout
        window: LeaseWindow = SharedKvPool(decode.kv_segment.name, layout).window(lease.block_ids)
        data = memoryview(bytearray(layout.block_nbytes))
        outside = KvPiece(0, len(lease.block_ids), 1, data, data)
        with pytest.raises(IndexError):
            window.write(outside)
        inside = KvPiece(0, 0, 1, data, data)
        assert window.write(inside) == chunk_crc32c(data, data)
        # The first block shared with another lease: read-only through this window.
        sharing = SharedKvPool(decode.kv_segment.name, layout).window(lease.block_ids, 1)
        with pytest.raises(IndexError, match="shared"):
            sharing.write(inside)
        assert sharing.write(KvPiece(0, 1, 1, data, data)) == chunk_crc32c(data, data)


def _mapped_kb(address: int) -> int:
    """Resident kB of this process's mapping that starts at `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            return next(int(f.split()[1]) for f in lines[i + 1 :] if f.startswith("Rss:"))
    raise AssertionError(f"no mapping at {address:#x}")


def test_a_segment_is_mapped_lazily_a_block_on_its_first_write(tmp_path: Path) -> None:
    """The sender maps the decode's whole cache, but takes pages only for blocks it writes:
    populating a 2 GB cache on the first request cost seconds and counted its pages twice."""
    layout = KVCacheLayout(
        num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32"
    )
    num_blocks = 2048
    path = tmp_path / "pdserve-kv-1-lazy"
    segment_bytes = 2 * layout.num_layers * layout.block_nbytes * num_blocks
    with path.open("wb") as file:
        file.truncate(segment_bytes)
    path.chmod(0o600)
    pool = SharedKvPool(path.name, layout, directory=tmp_path)
    address = pool.blocks.ctypes.data
    assert _mapped_kb(address) == 0
    data = bytes(range(256)) * (layout.block_nbytes // 256)
    pool.window([7]).write(KvPiece(0, 0, 1, data, data))
    # NOTE: the kernel maps a written page's neighbours too (fault-around, large folios): a
    # few MB at most of the segment's 128.
    assert 2 * layout.block_nbytes // 1024 <= _mapped_kb(address) <= segment_bytes // 1024 // 16


def test_a_segment_other_users_may_open_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "pdserve-kv-1-open"
    path.write_bytes(bytes(4096))
    path.chmod(0o666)
    layout = KVCacheLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32")
    with pytest.raises(PermissionError):
        SharedKvPool(path.name, layout, directory=tmp_path)


# ---- a lease that ends while a writer holds it ----------------------------------------------


async def test_a_lease_expiring_mid_tcp_transfer_keeps_its_blocks_until_the_writer_stops(
    tiny_model_dir: Path,
) -> None:
    async with cluster(tiny_model_dir, decode_overrides={"lease_ttl_ms": 300}) as pd:
        decode = pd.decodes[0]
        lease = await pd.allocate(8)
        token = lease.transports[0].token
        with socket.create_connection(_tcp_address(lease)) as sock:
            sock.sendall(_header(lease, "r", 8, token))
            (held,) = decode.leases.table.open_leases()
            await eventually(lambda: held.status.name == "EXPIRED", 30, "the lease to expire")
            # Ended, yet its blocks are still out of the pool: the writer may still be writing.
            assert decode.leases.table.pool.num_used_blocks == len(lease.block_ids)
            commit = decode_pb2.SyncCacheRequest(commit=decode_pb2.SyncCacheCommit())
            sock.sendall(frame(commit.SerializeToString()))
            sock.settimeout(5)
            answer = decode_pb2.KvTcpResult.FromString(
                await asyncio.to_thread(recv_frame, sock, 1 << 16)
            )
        assert answer.error_reason == errors_pb2.ERROR_REASON_LEASE_EXPIRED
        await pd.eventually_whole()


async def test_a_lease_expiring_mid_shared_memory_transfer_is_held_until_the_stream_ends(
    tiny_model_dir: Path,
) -> None:
    async with cluster(tiny_model_dir, decode_overrides={"lease_ttl_ms": 300}) as pd:
        decode = pd.decodes[0]
        lease = await pd.allocate(8)
        header = decode_pb2.SyncCacheRequest(
            header=decode_pb2.SyncCacheHeader(
                lease_id=lease.lease_id,
                request_id="r",
                token_ids=list(range(1, 9)),
                transport_token=lease.transports[0].token,
                transport=decode_pb2.TRANSPORT_KIND_SHARED_MEMORY,
            )
        )
        call = pd.decode_stubs[0].SyncCache()
        await call.write(header)
        metadata = dict(await call.initial_metadata())
        assert metadata.get("pdserve-sync-accepted") == "1"  # the sender may write now
        (held,) = decode.leases.table.open_leases()
        await eventually(lambda: held.status.name == "EXPIRED", 30, "the lease to expire")
        assert decode.leases.table.pool.num_used_blocks == len(lease.block_ids)
        await call.write(decode_pb2.SyncCacheRequest(commit=decode_pb2.SyncCacheCommit()))
        await call.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call
        assert errors.from_rpc_error(raised.value).reason is ErrorReason.LEASE_EXPIRED
        await pd.eventually_whole()


async def test_tcp_into_a_cache_through_host_staging_as_into_a_cuda_cache(
    tiny_model_dir: Path, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged: list[int] = []

    class CountingStaging(HostStaging):
        def fill(self, layer_index, block_ids, fill):  # type: ignore[no-untyped-def]
            staged.append(layer_index)
            return super().fill(layer_index, block_ids, fill)

    def receiver(kv_cache: KVCache, lease: DecodeRequest) -> KvReceiver:
        return KvReceiver(kv_cache, lease, CountingStaging(kv_cache))

    monkeypatch.setattr(transfers, "KvReceiver", receiver)
    async with cluster(tiny_model_dir, kv_transports="tcp") as pd:
        assert await pd.complete("r", LONG, GREEDY) == engine.generate([LONG], GREEDY)[0]
        assert staged
        await pd.eventually_whole()
