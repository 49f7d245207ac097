"""Each request's KV transfer as its handoff starts it: traced, counted once acknowledged.

Once a request holds its decode lease, `KvTransfers.start` gives it a `KvSender` on the
channels the lease allows (`transports.channels_for`) and runs it in a task inside a
``prefill.kv_transfer`` span; when that task ends the span gets what was sent, and a transfer
the decode acknowledged is counted (bytes, handoffs, and its duration in the metrics).
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import time
from collections.abc import Sequence

from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.engine.kv_cache import KVCache
from pdserve.kv.transports.cuda_ipc_window import MappedCaches
from pdserve.prefill.in_flight import InFlight
from pdserve.prefill.kv.nixl import NixlSide
from pdserve.prefill.kv.sender import KvSender
from pdserve.prefill.kv.shm import SharedPools
from pdserve.prefill.kv.transports import channels_for
from pdserve.prefill.metrics import PrefillMetrics
from pdserve.v1 import decode_pb2_grpc

_tracer = telemetry.tracer("pdserve.prefill")


class KvTransfers:
    """Starts the KV transfers of one prefill instance's requests and counts those that
    completed.

    Args:
        kv_cache: The prefill's KV cache (the source of cuda_ipc copies; its layout for the
            shared-memory pools).
        kv_transports: The KV transports this prefill may use, in order of preference.
        fault_corrupt_kv: Request-id pattern whose first KV chunk is corrupted on purpose
            (fault injection for chaos tests), or None.
        window_layers: The model's sliding-window layers (which a decode may keep in window
            storage, addressed through its lease's slots).
    """

    def __init__(
        self,
        kv_cache: KVCache,
        kv_transports: Sequence[str] = ("grpc",),
        fault_corrupt_kv: str | None = None,
        window_layers: Sequence[int] = (),
    ) -> None:
        self.kv_transports = tuple(kv_transports)
        self.fault_corrupt_kv = fault_corrupt_kv
        self.shared_pools = SharedPools(kv_cache.layout, window_layers)
        self.mapped_caches = MappedCaches(kv_cache)
        # NOTE: this prefill's NIXL agent starts on a thread now; transfers that come first
        # wait for it (and fall back if it does not start).
        self.nixl = NixlSide(kv_cache) if "nixl" in self.kv_transports else None
        self.metrics: PrefillMetrics | None = None
        self.num_kv_bytes_sent = 0
        self.num_handed_off = 0

    def start(self, flight: InFlight, stub: decode_pb2_grpc.DecodeServiceStub) -> None:
        """Starts the transfer of `flight`'s request, which holds its lease (``sender`` and
        ``sender_task`` are set on `flight`).

        Raises:
            PdserveError: INCOMPATIBLE_PEER when the decode offers none of the transports.
        """
        request = flight.request
        corrupt = self.fault_corrupt_kv is not None and fnmatch.fnmatchcase(
            request.request_id, self.fault_corrupt_kv
        )
        sender = flight.sender = KvSender(
            request,
            channels_for(
                request,
                stub,
                self.shared_pools,
                self.kv_transports,
                self.mapped_caches,
                self.nixl,
            ),
            corrupt_first_chunk=corrupt,
        )
        span = _tracer.start_span(
            "prefill.kv_transfer", attributes={telemetry.REQUEST_ID: request.request_id}
        )
        # NOTE: the task copies the current context: its SyncCache call joins the span.
        with telemetry.activated(span):
            flight.sender_task = asyncio.create_task(sender.run())
        flight.sender_task.add_done_callback(
            functools.partial(self._on_done, span, sender, time.perf_counter())
        )

    def _on_done(
        self, span: trace.Span, sender: KvSender, started: float, done: asyncio.Task[object]
    ) -> None:
        span.set_attribute("pdserve.transport", sender.transport)
        span.set_attribute("pdserve.transport.reason", sender.transport_reason)
        span.set_attribute("pdserve.kv.seconds", time.perf_counter() - started)
        span.set_attribute("pdserve.kv.num_bytes", sender.num_bytes)
        span.set_attribute("pdserve.kv.num_chunks", sender.num_chunks)
        if done.cancelled() or done.exception() is not None:
            span.set_status(trace.Status(trace.StatusCode.ERROR, "transfer failed"))
        else:
            self.num_kv_bytes_sent += sender.num_bytes
            self.num_handed_off += 1
            if self.metrics is not None:
                seconds = time.perf_counter() - started
                self.metrics.transfer_seconds.labels(sender.transport).observe(seconds)
        span.end()
