"""The prefill's side of the KV storage tier: load stored prefixes, write computed blocks.

**Load.** Before a request reaches the engine thread, `StoreLoader.load` looks up, on a worker
thread, the leading full blocks of its tokens that the local prefix cache does not hold: how
many of the remaining keys the store has (`contains_prefix`), then those entries
(`get_blocks`, checked), up to the first miss. The payloads ride on the request; at admission
the scheduler copies them into the request's new blocks (`take_stored_blocks`) and computing
starts after them. The last token is always computed (its logits give the first token). A
miss of any kind, or a store error, ends the loaded run there: that block and everything after
it are computed, so the output never depends on the store. A store found unreachable is not
looked up until its probe reaches it again (`KvStore.is_reachable`): the request computes at
once instead of waiting on it. The lookup runs before the request asks a decode for a lease
(`pdserve.prefill.handoff`), so a store that hangs delays a request without costing its lease.

**Write-through.** After a pass fills full blocks of a prompt, `write_through` (on the engine
thread) copies them out in one gather and queues them on the instance's `KvStoreWriter`;
keys known to be stored (written or loaded recently) are skipped.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from pdserve.common import telemetry
from pdserve.engine.block_pool import prefix_block_keys
from pdserve.engine.kv_cache import KVCache
from pdserve.kv.codec import MissCause, block_payload_nbytes, export_block_payloads
from pdserve.kv.offload import KvStoreWriter
from pdserve.kv.store import KvStore, KvStoreSkipped, KvStoreUnavailable
from pdserve.prefill.request import Request

log = structlog.get_logger(__name__)
_tracer = telemetry.tracer("pdserve.prefill")

MAX_KNOWN_KEYS = 1 << 16
LOAD_THREADS = 2


class StoreLoader:
    """Loads a request's stored prefix before admission and writes computed blocks through.

    Args:
        store: The KV store.
        writer: The instance's store writer.
        kv_cache: The prefill's KV cache (read by `write_through`).
        block_size: Tokens per block.
        num_locally_cached: Counts how many leading keys the local prefix cache holds (called
            from a worker thread; must lock what it reads).

    Attributes:
        num_lookups: Requests looked up in the store.
        num_blocks_found: Blocks the lookups returned (before admission used them).
        num_errors: Lookups that failed (the store was down).
        num_skipped: Lookups not tried: the store was found unreachable and no probe has
            reached it since.
    """

    def __init__(
        self,
        store: KvStore,
        writer: KvStoreWriter,
        kv_cache: KVCache,
        block_size: int,
        num_locally_cached: Callable[[Sequence[bytes]], int],
    ) -> None:
        self.store = store
        self.writer = writer
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.fingerprint = writer.fingerprint
        self.payload_nbytes = block_payload_nbytes(kv_cache.layout)
        self.num_locally_cached = num_locally_cached
        self.num_lookups = 0
        self.num_blocks_found = 0
        self.num_errors = 0
        self.num_skipped = 0
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._known_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="kv-store-load")

    # ---- load (event loop, then a worker thread) -------------------------------------------

    async def load(self, request: Request) -> None:
        """Sets ``request.stored_payloads`` to the stored blocks after its locally cached
        prefix (none when the store has none or fails), in a ``kv_store.get`` span."""
        with _tracer.start_as_current_span(
            "kv_store.get", attributes={telemetry.REQUEST_ID: request.request_id}
        ) as span:
            aio_loop = asyncio.get_running_loop()
            num_asked = await aio_loop.run_in_executor(self._executor, self._lookup, request)
            span.set_attributes(
                {
                    "pdserve.kv_store.num_blocks_asked": num_asked,
                    "pdserve.kv_store.num_blocks": len(request.stored_payloads),
                    "pdserve.kv_store.first_block": request.stored_first_block,
                }
            )

    def _lookup(self, request: Request) -> int:
        """Fills ``request.block_keys`` and its stored payloads; returns the blocks asked for."""
        request.block_keys = prefix_block_keys(self.fingerprint, request.token_ids, self.block_size)
        if request.sampling.prompt_logprobs is not None:
            return 0  # NOTE: scoring the prompt computes every position: nothing to load.
        max_blocks = (request.num_tokens - 1) // self.block_size
        first = self.num_locally_cached(request.block_keys[:max_blocks])
        wanted = request.block_keys[first:max_blocks]
        if not wanted:
            return 0
        self.num_lookups += 1
        if not self.store.is_reachable:
            self.num_skipped += 1
            return len(wanted)
        try:
            num_present = self.store.contains_prefix(wanted)
            if num_present < len(wanted):
                self.store.stats.record_lookup(0, [MissCause.MISSING])
            payloads = self.store.get_blocks(
                wanted[:num_present], self.fingerprint, self.payload_nbytes
            )
        except KvStoreSkipped:
            self.num_skipped += 1  # NOTE: found unreachable since the check above
            return len(wanted)
        except KvStoreUnavailable as error:
            self.num_errors += 1
            log.warning("kv_store_error", op="get", request_id=request.request_id, error=str(error))
            return len(wanted)
        found = [p for p in itertools.takewhile(lambda p: p is not None, payloads) if p]
        request.stored_first_block = first
        request.stored_payloads = found
        self.num_blocks_found += len(found)
        self._remember(wanted[: len(found)])
        if found:
            log.info(
                "kv_store_hit",
                request_id=request.request_id,
                first_block=first,
                num_blocks=len(found),
                num_blocks_asked=len(wanted),
            )
        return len(wanted)

    # ---- write-through (engine thread) -----------------------------------------------------

    def write_through(self, request: Request, first_block: int, end_block: int) -> None:
        """Queues the request's full blocks [first_block, end_block) for the store, except
        those known to be stored (call on the engine thread, after the pass that filled them)."""
        end_block = min(end_block, len(request.block_keys))
        indexes = [
            i for i in range(first_block, end_block) if not self._is_known(request.block_keys[i])
        ]
        if not indexes:
            return
        keys = [request.block_keys[i] for i in indexes]
        payloads = export_block_payloads(self.kv_cache, [request.block_ids[i] for i in indexes])
        future = self.writer.submit(
            request.request_id, dict(zip(keys, payloads, strict=True)), request.trace_context
        )
        self._remember(keys)
        future.add_done_callback(lambda done: self._forget_unless_written(done, keys))

    def _forget_unless_written(self, done: Future[int], keys: list[bytes]) -> None:
        if done.exception() is not None:
            with self._known_lock:
                for key in keys:
                    self._known.pop(key, None)

    def _is_known(self, key: bytes) -> bool:
        with self._known_lock:
            return key in self._known

    def _remember(self, keys: Sequence[bytes]) -> None:
        with self._known_lock:
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
            while len(self._known) > MAX_KNOWN_KEYS:
                self._known.popitem(last=False)

    def close(self) -> None:
        """Stops the lookup threads (lookups in progress finish)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
