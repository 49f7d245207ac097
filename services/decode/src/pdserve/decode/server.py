"""A decode instance: the shared instance scaffold with the decode's parts plugged in.

`create_server(config)` builds one and starts serving; `serve(config)` runs one until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import grpc
import structlog

from pdserve.common import env
from pdserve.decode.config import DecodeConfig
from pdserve.decode.decode_loop import DecodeLoop
from pdserve.decode.events import PreemptionReason
from pdserve.decode.kv.tcp_server import KvTcpServer
from pdserve.decode.leases import LeaseManager
from pdserve.decode.metrics import DecodeMetrics
from pdserve.decode.offload import PreemptionOffload
from pdserve.decode.servicer import DecodeServicer
from pdserve.decode.sliding_kv import SlidingKV
from pdserve.decode.status import DecodeStatus
from pdserve.engine.block_pool import BlockPool
from pdserve.kv.transports.cuda_ipc import CacheExport, export_cache
from pdserve.kv.transports.nixl import AGENT_START_WAIT_S, CacheAgent, NixlUnavailable, start_agent
from pdserve.kv.transports.offer import TransportOffer
from pdserve.kv.transports.shm import KvSegment
from pdserve.serving.instance import InstanceServer
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

log = structlog.get_logger(__name__)

NOTICE_WAIT_S = 0.2
# NOTE: a TCP transfer may stay silent this long past the lease TTL before it fails (an
# expired lease keeps its blocks until its writer stops; this bounds that).
TCP_DATA_GRACE_S = 5.0
# Transports whose sender writes into the cache's memory addressing every layer by block id
# (shared memory and NIXL address window storage through the lease's slots).
BLOCK_ADDRESSED_TRANSPORTS = ("cuda_ipc",)


class DecodeInstance(InstanceServer):
    """A decode server: the lease table, the decode thread and DecodeService plugged into
    the shared scaffold (what tests and `serve` hold on to).

    Drain refuses new leases; requests still running at the deadline are preempted with a
    DRAINING notice so the gateway can continue them elsewhere.
    """

    role = common_pb2.INSTANCE_ROLE_DECODE
    service_name = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
    config: DecodeConfig
    leases: LeaseManager
    loop: DecodeLoop
    servicer: DecodeServicer
    status: DecodeStatus
    metrics: DecodeMetrics

    def build(self) -> None:
        config, host = self.config, self.host
        slots = host.runner.kv_cache.window_slots
        sliding = (
            None
            if slots is None
            else SlidingKV(slots, host.runner.model_config.widest_window, host.runner.block_size)
        )
        self.leases = LeaseManager(
            BlockPool(host.num_blocks),
            host.runner.block_size,
            config.reserve_tokens,
            config.lease_ttl_ms / 1000,
            config.capacity_retry_ms / 1000,
            max_model_len=host.max_model_len,
            max_lease_share=config.max_lease_share,
            is_insecure=self.security.is_insecure,
            sliding=sliding,
        )
        self.metrics = DecodeMetrics()
        if slots is not None:
            self.metrics.count_window_slots_with(lambda: slots.num_free, slots.num_slots)
        self.offload = (
            None
            if self.kv_writer is None
            else PreemptionOffload(
                self.kv_writer,
                host.runner.kv_cache,
                host.runner.block_size,
                config.kv_offload_wait_ms / 1000,
            )
        )
        self.loop = DecodeLoop(
            host.runner,
            self.leases,
            config.max_num_seqs,
            host.eos_token_ids,
            host.max_model_len,
            self.metrics,
            self.offload,
        )
        self.servicer = DecodeServicer(
            host,
            self.leases,
            self.loop,
            self.metrics,
            config.share_wait_ms / 1000,
            detached_keep_s=config.detached_keep_s,
            max_detached_requests=config.max_detached_requests,
        )
        self.servicer.instance_id = self.instance.instance_id
        self.kv_segment: KvSegment | None = None
        self.kv_export: CacheExport | None = None
        self.kv_tcp: KvTcpServer | None = None
        self.nixl_agent: CacheAgent | None = None
        self.is_closed = False
        self.kv_transport_kinds = self._transport_kinds()
        self.servicer.transport_offers = tuple(self._open_transports())
        self.nixl_started: Future[CacheAgent] | None = None
        if "nixl" in self.kv_transport_kinds:
            # NOTE: registered last: the cache no longer moves (a segment placed it).
            self.nixl_started = start_agent(host.runner.kv_cache, "decode")
            self.nixl_started.add_done_callback(self._offer_nixl)
        self.status = DecodeStatus(self.instance, self.leases, self.loop)

    def _open_transports(self) -> Iterator[TransportOffer]:
        """Sets up the offered KV transports besides gRPC; one that cannot be set up is left
        out with a warning (prefills then use the next)."""
        config, host = self.config, self.host
        kv_cache = host.runner.kv_cache
        for kind in self.kv_transport_kinds:
            if kind == "cuda_ipc":
                offer = self._export_cache()
                if offer is not None:
                    yield offer
            elif kind == "shm" and kv_cache.device.type != "cpu":
                # NOTE: the prefill writes the segment from the host (cuda_ipc maps a CUDA cache).
                log.warning(
                    "kv_transport_unavailable", transport=kind, detail="the KV cache is not on CPU"
                )
            elif kind == "shm":
                try:
                    if self.kv_segment is None:
                        # NOTE: at construction, before the loop or the servicer runs: no
                        # block was handed out, so the empty cache moves without a copy.
                        self.kv_segment = KvSegment.create(kv_cache, is_empty=True)
                except (OSError, ValueError) as error:
                    log.warning("kv_transport_unavailable", transport="shm", detail=str(error))
                    continue
                yield TransportOffer("shm", self.kv_segment.name)
            elif kind == "tcp":
                self.kv_tcp = KvTcpServer(
                    self.servicer.transfers,
                    config.host,
                    config.kv_tcp_port,
                    host.max_model_len,
                    data_timeout_s=config.lease_ttl_ms / 1000 + TCP_DATA_GRACE_S,
                )
                advertised_host = self.address.rsplit(":", 1)[0]
                yield TransportOffer("tcp", f"{advertised_host}:{self.kv_tcp.port}")

    def _transport_kinds(self) -> tuple[str, ...]:
        """The configured transports this cache can take: one whose sliding layers keep only
        their window takes its KV through `KVCache.import_blocks` (gRPC, TCP) or written in
        place through the lease's slots (shm, NIXL), not by a sender that addresses every
        layer by block id (CUDA IPC)."""
        kinds = self.config.kv_transport_kinds
        if self.host.runner.kv_cache.window_slots is None:
            return kinds
        for kind in [k for k in kinds if k in BLOCK_ADDRESSED_TRANSPORTS]:
            log.warning(
                "kv_transport_unavailable",
                transport=kind,
                detail="the sliding-window layers keep only their window "
                "(--release-window-blocks): this transport addresses every layer by block id",
            )
        return tuple(k for k in kinds if k not in BLOCK_ADDRESSED_TRANSPORTS)

    async def start(self) -> None:
        if self.nixl_started is not None:
            # NOTE: the first lease already offers NIXL (the agent's start is about half a
            # second, once per process).
            with contextlib.suppress(NixlUnavailable):  # NOTE: `_offer_nixl` logged why
                await asyncio.wrap_future(self.nixl_started)
        await super().start()

    def _offer_nixl(self, started: Future[CacheAgent]) -> None:
        """Once the NIXL agent started (on its thread): offers it, or says why not."""
        try:
            agent = self.nixl_agent = started.result()
        except NixlUnavailable as error:
            log.info("kv_transport_unavailable", transport="nixl", detail=str(error))
            return
        if self.is_closed:
            agent.close()
            return
        offer = TransportOffer("nixl", "", nixl=agent.target())
        self.servicer.nixl_progress = agent.progress
        # NOTE: one assignment: the servicer reads the whole tuple per lease.
        self.servicer.transport_offers = (offer, *self.servicer.transport_offers)
        log.info(
            "kv_transport_ready",
            transport="nixl",
            agent=agent.name,
            backend="UCX",
            memory_kind=agent.memory_kind,
            detail="offered: prefills that have NIXL use it in their --kv-transports order",
        )

    def _export_cache(self) -> TransportOffer | None:
        """The cuda_ipc offer: the cache exported once (on CUDA, or on CPU through the stand-in
        when enabled); None where it is not offered."""
        kv_cache = self.host.runner.kv_cache
        if kv_cache.device.type != "cuda" and not (
            kv_cache.device.type == "cpu" and env.kv_ipc_standin()
        ):
            log.info(
                "kv_transport_unavailable",
                transport="cuda_ipc",
                detail="the KV cache is not on CUDA",
            )
            return None
        try:
            export = export_cache(kv_cache, self.kv_segment)
        except (OSError, ValueError, RuntimeError) as error:
            log.warning("kv_transport_unavailable", transport="cuda_ipc", detail=str(error))
            return None
        self.kv_segment = export.segment or self.kv_segment
        self.kv_export = export
        return TransportOffer("cuda_ipc", "", export.handle)

    def describe(self) -> dict[str, object]:
        offers = self.servicer.transport_offers
        return {**super().describe(), "kv_transports": [o.kind for o in offers] + ["grpc"]}

    def add_service(self, server: grpc.aio.Server) -> None:
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self.servicer, server)

    def counters(self) -> Mapping[str, tuple[str, float]]:
        loop, leases = self.loop, self.leases
        return {
            "generated_tokens": ("Tokens generated by decode steps.", loop.num_generated_tokens),
            "steps": ("Batched decode steps run.", loop.num_steps),
            "preemptions": ("Requests preempted for lack of blocks.", loop.num_preemptions),
            "leases_granted": ("Leases granted by AllocateBlocks.", leases.num_granted),
            "leases_refused": ("AllocateBlocks refused for capacity.", leases.num_refused),
            "lease_access_refused": (
                "SyncCache and ReleaseLease calls refused (wrong token, request id or caller).",
                leases.num_access_refused,
            ),
            "lease_expiries": ("Leases reclaimed after their TTL.", leases.table.num_expired),
            "leases_shared": (
                "Leases granted with prompt blocks shared from another completion's lease.",
                leases.num_shared_leases,
            ),
            "shared_blocks": (
                "Prompt blocks leases shared with another completion's lease instead of "
                "receiving them.",
                leases.num_shared_blocks,
            ),
            "kv_received_bytes": (
                "KV bytes received in committed transfers.",
                self.servicer.num_kv_bytes_received,
            ),
            "kv_tcp_refused": (
                "TCP data-port connections closed at once (no header, or a wrong, expired or "
                "used lease token).",
                0 if self.kv_tcp is None else self.kv_tcp.num_refused,
            ),
            **self._offload_counters(),
        }

    def _offload_counters(self) -> dict[str, tuple[str, float]]:
        if self.offload is None or self.kv_writer is None:
            return {}
        return {
            "kv_offloads_written": (
                "Preempted requests whose blocks reached the KV store before their notice.",
                self.offload.num_written,
            ),
            "kv_offloads_skipped": (
                "Preempted requests noticed without a stored prefix (store down or full, "
                "writer behind, or the write late).",
                self.offload.num_skipped,
            ),
            "kv_offload_blocks": (
                "Blocks copied out of the cache for offloads.",
                self.offload.num_blocks_exported,
            ),
            "kv_store_writes_dropped": (
                "KV store writes dropped because the writer fell behind.",
                self.kv_writer.num_dropped,
            ),
        }

    def stop_admitting(self) -> None:
        self.leases.is_draining = True

    def num_in_flight(self) -> int:
        return len(self.leases.table.open_leases())

    def background(self) -> list[Coroutine[Any, Any, None]]:
        if self.kv_tcp is not None:
            self.kv_tcp.start(asyncio.get_running_loop())
        sweep_interval_s = min(1.0, self.config.lease_ttl_ms / 1000 / 10)
        return [run_expiry_sweeper(self.servicer, sweep_interval_s)]

    async def at_drain_deadline(self) -> None:
        self.loop.preempt_all(PreemptionReason.DRAINING)
        await asyncio.sleep(NOTICE_WAIT_S)  # let the notices reach their streams
        if self.offload is not None:
            # NOTE: notices wait for their offloads (bounded by --kv-offload-wait-ms).
            deadline = time.monotonic() + self.offload.wait_s
            while self.offload.num_pending and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(NOTICE_WAIT_S)

    async def abort_in_flight(self) -> None:
        # NOTE: a cancelled Generate stream releases its lease itself (a resumable one's
        # request runs on detached; the drain deadline preempted it, or stopping ends it).
        pass

    async def close(self) -> None:
        self.is_closed = True
        if self.nixl_started is not None:
            # NOTE: a process that exits while NIXL builds its agent on a thread aborts.
            await asyncio.to_thread(futures.wait, [self.nixl_started], AGENT_START_WAIT_S)
        if self.nixl_agent is not None:
            self.nixl_agent.close()
        if self.kv_tcp is not None:
            self.kv_tcp.stop()
        if self.kv_segment is not None:
            self.kv_segment.remove()


async def run_expiry_sweeper(servicer: DecodeServicer, interval_s: float) -> None:
    """Background task: reclaims expired leases every `interval_s` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            servicer.expire_due()
        except Exception as error:
            log.exception("expiry_sweep_failed", error=str(error))


async def create_server(
    config: DecodeConfig,
    host: ModelHost | None = None,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> DecodeInstance:
    """Builds a decode instance and starts serving it (`InstanceServer` explains the arguments)."""
    instance = DecodeInstance(config, host, interceptors)
    await instance.start()
    log.info("decode_started", **instance.describe())
    return instance


async def serve(config: DecodeConfig) -> None:
    """Runs a decode instance until SIGTERM/SIGINT, then drains and exits."""
    instance = await create_server(config)
    await instance.run_until_signal()
    log.info("decode_stopped")
