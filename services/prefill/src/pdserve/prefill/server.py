"""A prefill instance: the shared instance scaffold with the prefill's parts plugged in.

`create_server(config)` builds one and starts serving; `serve(config)` runs one until SIGTERM.
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import grpc
import structlog

from pdserve.common import env
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.convert import PrefillRequestBounds
from pdserve.prefill.decode_client import DecodePeers
from pdserve.prefill.handoff import Handoffs
from pdserve.prefill.metrics import PrefillMetrics
from pdserve.prefill.prefill_loop import PrefillLoop
from pdserve.prefill.servicer import PrefillServicer
from pdserve.prefill.status import PrefillStatus
from pdserve.prefill.store_loader import StoreLoader
from pdserve.serving.instance import InstanceServer
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = structlog.get_logger(__name__)


class PrefillInstance(InstanceServer):
    """A prefill server: the engine thread, the decode peers, the handoffs and
    PrefillService plugged into the shared scaffold (what tests and `serve` hold on to).

    Drain refuses new requests; requests still in flight at the deadline are aborted, which
    releases their decode leases.
    """

    role = common_pb2.INSTANCE_ROLE_PREFILL
    service_name = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
    config: PrefillConfig
    loop: PrefillLoop
    peers: DecodePeers
    handoffs: Handoffs
    servicer: PrefillServicer
    status: PrefillStatus
    metrics: PrefillMetrics

    def build(self) -> None:
        config, host = self.config, self.host
        self.loop = PrefillLoop(
            host.runner,
            config.max_num_batched_tokens,
            config.max_chunk_bytes,
            enable_prefix_cache=config.prefix_cache,
            prefix_cache_max_tokens=config.prefix_cache_max_tokens,
            kv_fingerprint=host.kv_layout.fingerprint,
            eos_token_ids=host.eos_token_ids,
        )
        if self.kv_store is not None and self.kv_writer is not None:
            self.loop.store_loader = StoreLoader(
                self.kv_store,
                self.kv_writer,
                host.runner.kv_cache,
                host.runner.block_size,
                self.loop.num_cached_leading_blocks,
            )
        self.peers = DecodePeers(
            self.instance.instance_id,
            host.kv_layout,
            config.prepare_concurrency,
            config.allocate_timeout_ms / 1000,
            self.security,
        )
        self.handoffs = Handoffs(
            self.loop,
            self.peers,
            host.eos_token_ids,
            host.max_model_len,
            config.max_queue_len,
            config.kv_transport_kinds,
            env.fault_corrupt_kv(),
            host.constraint_compiler(),
            config.lease_window_bound,
        )
        limits = PrefillRequestBounds(
            vocab_size=host.runner.model_config.vocab_size,
            max_model_len=host.max_model_len,
            max_prompt_blocks=host.num_blocks,
            block_size=host.runner.block_size,
        )
        self.servicer = PrefillServicer(host, self.handoffs, self.instance, limits)
        self.status = PrefillStatus(self.instance, self.handoffs, self.loop)
        self.metrics = PrefillMetrics()
        self.loop.metrics = self.handoffs.metrics = self.handoffs.transfers.metrics = self.metrics

    def add_service(self, server: grpc.aio.Server) -> None:
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(self.servicer, server)

    def counters(self) -> Mapping[str, tuple[str, float]]:
        loop, transfers, scheduler = self.loop, self.handoffs.transfers, self.loop.scheduler
        return {
            "prompt_tokens": (
                "Prompt tokens computed by forward passes (rate() gives tokens/s).",
                loop.num_prompt_tokens,
            ),
            "cached_prompt_tokens": (
                "Prompt tokens taken from the prefix cache instead of computed.",
                scheduler.num_cached_prompt_tokens,
            ),
            "prefix_cache_hit_blocks": (
                "Cached blocks that admitted requests shared instead of computing.",
                scheduler.num_cache_hit_blocks,
            ),
            "store_loaded_prompt_tokens": (
                "Prompt tokens loaded from the KV store instead of computed.",
                scheduler.num_loaded_prompt_tokens,
            ),
            "passes": ("Prefill forward passes run.", loop.num_passes),
            "handed_off": ("Requests whose KV the decode acknowledged.", transfers.num_handed_off),
            "kv_sent_bytes": ("KV bytes in acknowledged transfers.", transfers.num_kv_bytes_sent),
            **self._store_counters(),
        }

    def _store_counters(self) -> dict[str, tuple[str, float]]:
        loader, writer = self.loop.store_loader, self.kv_writer
        if loader is None or writer is None:
            return {}
        return {
            "kv_store_lookups": ("Requests whose prefix was looked up in the KV store.",
                                 loader.num_lookups),
            "kv_store_lookups_skipped": ("Lookups not tried: the KV store was unreachable (the "
                                         "prompt was computed).", loader.num_skipped),
            "kv_store_writes": ("Write-through batches of computed blocks that reached the "
                                "KV store.", writer.num_written),
            "kv_store_written_blocks": ("Computed blocks written through to the KV store.",
                                        writer.num_blocks_written),
            "kv_store_writes_skipped": ("Write-through batches that did not reach the KV store "
                                        "(store down or full, or the writer behind).",
                                        writer.num_failed + writer.num_dropped),
        }  # fmt: skip

    def stop_admitting(self) -> None:
        self.handoffs.is_draining = True

    def num_in_flight(self) -> int:
        return len(self.handoffs.live)

    def background(self) -> list[Coroutine[Any, Any, None]]:
        return []

    async def at_drain_deadline(self) -> None:
        pass  # NOTE: `stop` aborts them, which releases their decode leases.

    async def abort_in_flight(self) -> None:
        await self.handoffs.abort_all()

    async def close(self) -> None:
        await self.peers.close()
        if self.handoffs.transfers.nixl is not None:
            self.handoffs.transfers.nixl.close()
        if self.loop.store_loader is not None:
            self.loop.store_loader.close()


async def create_server(
    config: PrefillConfig,
    host: ModelHost | None = None,
    *,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> PrefillInstance:
    """Builds a prefill instance and starts serving it (`InstanceServer` explains the arguments)."""
    instance = PrefillInstance(config, host, interceptors)
    await instance.start()
    fault = instance.handoffs.transfers.fault_corrupt_kv
    if fault is not None:
        log.warning("fault_injection_enabled", fault="corrupt_kv", request_id_pattern=fault)
    log.info(
        "prefill_started",
        **instance.describe(),
        max_num_batched_tokens=config.max_num_batched_tokens,
        lease_window_tokens=config.lease_window_bound,
        prefix_cache=config.prefix_cache,
        prefix_cache_max_tokens=config.prefix_cache_max_tokens,
        kv_store=config.kv_store,
    )
    return instance


async def serve(config: PrefillConfig) -> None:
    """Runs a prefill instance until SIGTERM/SIGINT, then drains and exits."""
    instance = await create_server(config)
    await instance.run_until_signal()
    log.info("prefill_stopped")
