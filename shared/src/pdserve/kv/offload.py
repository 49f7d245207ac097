"""Writes KV blocks to the storage tier on a worker thread (decode offloads, prefill write-through).

The engine threads copy a request's blocks out of the cache (`export_block_payloads`, one
gather) and hand the payloads to a `KvStoreWriter`; its thread does the store I/O, so a slow or
dead store never stalls a forward pass. The queue is bounded: when the writer falls behind the
oldest write is dropped (and counted), never the engine. Every write resolves a future with the
bytes written, or with an exception (`KvStoreUnavailable`, `WriteDropped`); a caller that
waits for it waits a bounded time. (`kv_tier` opens the store and exports its counters.)
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

import structlog
from opentelemetry import trace
from opentelemetry.context import Context

from pdserve.common import telemetry
from pdserve.engine.thread import EngineThread
from pdserve.kv.store import KvStore, KvStoreFull, KvStoreSkipped, KvStoreUnavailable

log = structlog.get_logger(__name__)
_tracer = telemetry.tracer("pdserve.serving")


class WriteDropped(Exception):
    """The write never reached the store: the writer fell behind or stopped."""


@dataclass
class _Write:
    request_id: str
    payloads: dict[bytes, bytes]  # block key -> payload
    future: Future[int]
    trace_context: Context | None


class KvStoreWriter(EngineThread):
    """A worker thread that stores block payloads, oldest write first, dropping the oldest
    when more than `max_queue_len` wait.

    Args:
        store: The store written to.
        fingerprint: The KV layout fingerprint entries are stamped with.
        max_queue_len: Most writes waiting at once.

    Attributes:
        num_written: Writes that reached the store.
        num_failed: Writes the store refused or could not take (`KvStoreUnavailable`).
        num_dropped: Writes dropped unwritten (queue full, or the writer stopped).
        num_blocks_written: Blocks in the writes that reached the store.
    """

    def __init__(self, store: KvStore, fingerprint: str, max_queue_len: int) -> None:
        if max_queue_len <= 0:
            raise ValueError(f"max_queue_len must be positive, got {max_queue_len}")
        self.store = store
        self.fingerprint = fingerprint
        self.max_queue_len = max_queue_len
        self.num_written = 0
        self.num_failed = 0
        self.num_dropped = 0
        self.num_blocks_written = 0
        self._queue: collections.deque[_Write] = collections.deque()
        super().__init__("kv-store-writer")

    def submit(
        self,
        request_id: str,
        payloads: Mapping[bytes, bytes],
        trace_context: Context | None = None,
    ) -> Future[int]:
        """Queues payloads (block key -> `export_block_payloads` bytes) for the store.

        Returns:
            Resolves with the bytes written, or fails with `KvStoreUnavailable` or
            `WriteDropped`.
        """
        write = _Write(request_id, dict(payloads), Future(), trace_context)
        dropped: _Write | None = None
        with self._cond:
            if self._is_stopped:
                dropped = write
            else:
                if len(self._queue) >= self.max_queue_len:
                    dropped = self._queue.popleft()
                self._queue.append(write)
                self._cond.notify()
            if dropped is not None:
                self.num_dropped += 1
        if dropped is not None:
            log.warning(
                "kv_store_write_dropped",
                request_id=dropped.request_id,
                num_blocks=len(dropped.payloads),
                max_queue_len=self.max_queue_len,
            )
            dropped.future.set_exception(WriteDropped("the KV store writer fell behind"))
        return write.future

    @property
    def num_queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stops after the write in progress; writes still queued fail with `WriteDropped`
        (also before `start`: then every write fails). Returns whether the thread stopped."""
        stopped = True
        if self._thread.ident is not None:
            stopped = super().stop(timeout_s)
        with self._cond:
            self._is_stopped = True
        with self._cond:
            left, self._queue = list(self._queue), collections.deque()
            self.num_dropped += len(left)
        for write in left:
            write.future.set_exception(WriteDropped("the KV store writer stopped"))
        return stopped

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._is_stopped or self._queue):
                    self._cond.wait()
                if self._is_stopped:
                    return
                write = self._queue.popleft()
            self._write(write)

    def _write(self, write: _Write) -> None:
        span = _tracer.start_span(
            "kv_store.put",
            context=write.trace_context,
            attributes={
                telemetry.REQUEST_ID: write.request_id,
                "pdserve.kv_store.num_blocks": len(write.payloads),
            },
        )
        try:
            num_bytes = self.store.put_blocks(self.fingerprint, write.payloads)
        except KvStoreUnavailable as error:
            self.num_failed += 1
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
            span.end()
            # NOTE: a store found unreachable or full was logged once (`kv_store_unreachable`,
            # `kv_store_full`): a write failing for it is counted, not logged one by one.
            is_known = isinstance(error, (KvStoreSkipped, KvStoreFull))
            report = log.debug if is_known else log.warning
            report("kv_store_error", op="put", request_id=write.request_id, error=str(error))
            write.future.set_exception(error)
            return
        except Exception as error:  # a bug must not kill the writer thread
            self.num_failed += 1
            span.end()
            log.exception("kv_store_write_failed", request_id=write.request_id)
            write.future.set_exception(error)
            return
        self.num_written += 1
        self.num_blocks_written += len(write.payloads)
        span.set_attribute("pdserve.kv_store.num_bytes", num_bytes)
        span.end()
        write.future.set_result(num_bytes)
