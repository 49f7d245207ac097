"""Offload on preemption: a preempted request's computed KV goes to the storage tier.

On the decode thread, before the victim's blocks are freed, `PreemptionOffload.start` copies
its full blocks (every token whose KV is computed: prompt and generated so far) out of the
cache in one gather and hands them to the `KvStoreWriter`. The preemption notice then waits,
on the event loop and at most ``--kv-offload-wait-ms``, for that write: if it landed the
notice carries ``stored_prefix_key`` (the hex key of the last stored block), else it goes
without one. Either way the notice is the stream's last message, after every token (they
were all emitted before the preemption), and the reschedule is correct: a prefill that finds
the blocks loads them, one that does not recomputes them.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NamedTuple

import structlog
from opentelemetry import trace

from pdserve.decode.events import PreemptedEvent
from pdserve.decode.request import DecodeRequest
from pdserve.engine.block_pool import prefix_block_keys
from pdserve.engine.kv_cache import KVCache
from pdserve.kv.codec import export_block_payloads
from pdserve.kv.offload import KvStoreWriter, WriteDropped

log = structlog.get_logger(__name__)


class StartedOffload(NamedTuple):
    """A preempted request's blocks on their way to the store."""

    future: Future[int]
    num_blocks: int
    stored_prefix_key: str  # hex key of the last block


@dataclass(eq=False)
class PreemptionOffload:
    """Stores preempted requests' blocks and holds their notices until the write landed.

    Args:
        writer: The instance's KV store writer.
        kv_cache: The decode's KV cache.
        block_size: Tokens per block.
        wait_s: Longest a notice waits for its write.

    Attributes:
        num_written: Offloads that landed in the store before their notice was sent.
        num_skipped: Offloads whose notice went without a key (store error, dropped, late).
        num_blocks_exported: Blocks copied out of the cache for offloads.
    """

    writer: KvStoreWriter
    kv_cache: KVCache
    block_size: int
    wait_s: float
    num_written: int = field(default=0, init=False)
    num_skipped: int = field(default=0, init=False)
    num_blocks_exported: int = field(default=0, init=False)
    _num_pending: int = field(default=0, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def num_pending(self) -> int:
        """Notices still waiting for their write."""
        with self._lock:
            return self._num_pending

    def start(self, request: DecodeRequest) -> StartedOffload | None:
        """Copies `request`'s full blocks out of the cache and queues their write (on the
        decode thread, before its blocks are freed); None when it has no full block."""
        num_full = request.num_computed_tokens // self.block_size
        if num_full == 0:
            return None
        if request.num_window_released:
            # NOTE: its first blocks no longer hold the sliding layers' KV (window slots), and
            # a stored block must hold every layer's: the reschedule recomputes them.
            log.info(
                "kv_offload_skipped",
                request_id=request.request_id,
                reason="sliding-window KV of its first blocks was let go",
                num_blocks=request.num_window_released,
            )
            self.num_skipped += 1
            return None
        keys = prefix_block_keys(
            self.writer.fingerprint,
            request.token_ids[: num_full * self.block_size],
            self.block_size,
        )
        try:
            # NOTE: one gather on this thread; the blocks are freed right after, the copy is ours.
            payloads = export_block_payloads(self.kv_cache, request.block_ids[:num_full])
        except Exception:  # an offload must never fail the decode step
            log.exception("kv_offload_export_failed", request_id=request.request_id)
            self.num_skipped += 1
            return None
        self.num_blocks_exported += num_full
        context = trace.set_span_in_context(request.span)
        payload_of_key = dict(zip(keys, payloads, strict=True))
        future = self.writer.submit(request.request_id, payload_of_key, context)
        with self._lock:
            self._num_pending += 1
        return StartedOffload(future, num_full, keys[-1].hex())

    def emit_notice(
        self, request: DecodeRequest, event: PreemptedEvent, started: StartedOffload | None
    ) -> None:
        """Emits the preemption notice: at once without an offload, else once the write
        landed (with its key) or the wait ran out (without). Call after the last token."""
        if started is None:
            request.events.emit(event)
            return

        def notice(landed: Future[int] | None) -> PreemptedEvent:
            with self._lock:
                self._num_pending -= 1
            return self._notice(request, event, started, landed)

        request.events.emit_when_done(started.future, self.wait_s, notice)

    def _notice(
        self,
        request: DecodeRequest,
        event: PreemptedEvent,
        started: StartedOffload,
        landed: Future[int] | None,
    ) -> PreemptedEvent:
        num_blocks, stored_key = started.num_blocks, started.stored_prefix_key
        if landed is not None and landed.exception() is None:
            self.num_written += 1
            log.info(
                "kv_offload_written",
                request_id=request.request_id,
                num_blocks=num_blocks,
                num_bytes=landed.result(),
                stored_prefix_key=stored_key,
            )
            return PreemptedEvent(event.reason, event.generated_token_ids, stored_key)
        self.num_skipped += 1
        error = None if landed is None else landed.exception()
        cause = (
            "timeout"
            if landed is None
            else "dropped"
            if isinstance(error, WriteDropped)
            else "store_error"
        )
        log.warning(
            "kv_offload_skipped",
            request_id=request.request_id,
            num_blocks=num_blocks,
            cause=cause,
            error=None if error is None else str(error),
        )
        return event
