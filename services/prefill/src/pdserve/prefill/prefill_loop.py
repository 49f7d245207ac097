"""The engine thread: forward passes over prepared requests, with KV exported layer by layer.

Each pass is scheduled by `PrefillScheduler`. While the model runs, `on_layer_done(i)` fires as soon
as layer i's KV of the whole pass is in the cache; the loop then exports
(`pdserve.prefill.kv.export`), for every request of the pass that ships KV, layer i of the blocks
this pass completed and hands the pieces to the request's sink, so the sender streams them while
layers i+1.. still compute. A block that a later chunk of the same prompt still fills is exported
with that chunk, never twice. After the pass, requests whose prompt is complete get their first
token sampled.

With the prefix cache on, a request's leading cached blocks are never computed, but their KV
is in the cache like any other: the first pass of such a request exports them too (its export
starts at block 0), so the decode still receives the whole prompt, in the same order.

With the KV store on, blocks admission filled from the store are copied into the cache before
the request's first pass (and exported like cached ones), and after each pass the full blocks
it computed are written through to the store (`StoreLoader.write_through`).

Submissions take effect between passes; a release frees the blocks at once unless the request
may be part of the running pass, in which case it waits for the pass boundary, so blocks are
never freed under a forward pass that writes them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import structlog
import torch
from opentelemetry import trace

from pdserve.common import telemetry
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.engine.batch import ScheduledChunk, SchedulerOutput
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.parallel.group import TensorParallelError
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import NO_TOKEN, NO_TOKEN_DETAIL, Sampler, SamplingRow
from pdserve.engine.sampling_ops import token_logprobs
from pdserve.engine.thread import EngineThread
from pdserve.kv.codec import import_block_payloads
from pdserve.kv.transfer import blocks_per_piece
from pdserve.prefill.chunk_spans import chunk_spans
from pdserve.prefill.events import EngineFailed, FirstTokenSampled
from pdserve.prefill.kv.export import export_layer, plan_export
from pdserve.prefill.metrics import PrefillMetrics
from pdserve.prefill.request import Request
from pdserve.prefill.scheduler import PrefillScheduler
from pdserve.prefill.store_loader import StoreLoader

log = structlog.get_logger(__name__)


class PrefillLoop(EngineThread):
    """Owns the prefill scheduler and its block pool; runs passes on its own thread.

    Args:
        runner: Forward passes over this prefill's KV cache.
        max_num_batched_tokens: Token budget of one pass.
        max_chunk_bytes: Most K+V bytes per exported piece.
        enable_prefix_cache: Keep freed full blocks as an evictable prefix cache and skip
            computing the leading blocks a request finds there.
        prefix_cache_max_tokens: The most tokens freed blocks keep cached (`BlockPool`'s
            bound on what it writes); None: every free block.
        kv_fingerprint: The KV layout fingerprint the cache's block keys are rooted in.
        eos_token_ids: The model's end-of-sequence ids (``min_tokens`` masks them).
    """

    def __init__(
        self,
        runner: ModelRunner,
        max_num_batched_tokens: int,
        max_chunk_bytes: int,
        *,
        enable_prefix_cache: bool = False,
        prefix_cache_max_tokens: int | None = None,
        kv_fingerprint: str = "",
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        max_cached = (
            None if prefix_cache_max_tokens is None else prefix_cache_max_tokens // self.block_size
        )
        self.scheduler = PrefillScheduler(
            BlockPool(
                runner.kv_cache.num_blocks, enable_prefix_cache, max_cached, track_written=True
            ),
            self.block_size,
            max_num_batched_tokens,
            kv_fingerprint,
        )
        self.blocks_per_piece = blocks_per_piece(runner.kv_cache.layout, max_chunk_bytes)
        # NOTE: a decode that keeps only these layers' window skips their leading blocks.
        self.window_layers = frozenset(runner.model_config.window_layers)
        self.sampler = Sampler(eos_token_ids)
        self.num_passes = 0
        self.num_prompt_tokens = 0
        self.metrics: PrefillMetrics | None = None
        self.store_loader: StoreLoader | None = None  # set by the server with --kv-store
        self.lock = threading.RLock()  # guards the scheduler (and so the pool)
        self._submitted: list[Request] = []
        self._releases: list[tuple[Request, Callable[[], None]]] = []
        self._is_blocked = False  # nothing fits until blocks are freed
        self._has_returned = False  # the thread left its loop: no pass can be running
        super().__init__("prefill-loop", self.lock)

    # ---- called from other threads ---------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queues a prepared request for prefill (FCFS)."""
        request.submitted_ns = time.time_ns()
        with self._cond:
            self._submitted.append(request)
            self._cond.notify()

    def release(self, request: Request, on_released: Callable[[], None]) -> None:
        """Forgets `request` and frees its blocks: at once unless a pass may be computing it,
        else at the next pass boundary.

        Args:
            request: A request given to `submit`.
            on_released: Called (on this thread or the engine thread) once the blocks are free.
        """
        with self._cond:
            if request in self._submitted:
                self._submitted.remove(request)
            # NOTE: only a request with uncomputed tokens can be part of the running pass; any
            # other is idle, and the scheduler's state is only touched under this lock. After
            # the thread has returned no pass runs, and nothing would take a queued release.
            if request not in self.scheduler.running or self._has_returned:
                self.scheduler.release(request)
                self._is_blocked = False  # freed blocks may admit a waiting request
                self._cond.notify()
                on_released()
                return
            self._releases.append((request, on_released))
            self._cond.notify()

    def num_cached_leading_blocks(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the local prefix cache holds now (any thread)."""
        with self.lock:
            pool = self.scheduler.pool
            if not pool.enable_prefix_caching:
                return 0
            num = 0
            while num < len(keys) and pool.get_cached_block(keys[num]) is not None:
                num += 1
            return num

    def num_tokens_to_compute(self, request: Request) -> int:
        """About how many of `request`'s prompt tokens a pass will compute, as the cache and
        the store stand now (`PrefillScheduler.num_reusable_blocks`). Fills
        ``request.block_keys`` when the prefix cache is on (any thread)."""
        # NOTE: the keys (hashing the prompt) outside the lock: they read no shared state.
        self.scheduler.fill_block_keys(request)
        with self.lock:
            num_reused = self.scheduler.num_reusable_blocks(request)
        return request.num_tokens - num_reused * self.block_size

    @property
    def num_waiting(self) -> int:
        """Prepared requests not yet admitted to a pass."""
        with self.lock:
            return len(self._submitted) + self.scheduler.num_waiting

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._is_stopped
                    or self._submitted
                    or self._releases
                    or (self.scheduler.has_unfinished_requests() and not self._is_blocked)
                ):
                    self._wait_for_work()
                releases, self._releases = self._releases, []
                for request, on_released in releases:
                    self.scheduler.release(request)
                    on_released()
                if self._is_stopped:
                    # NOTE: the releases queued before the stop (during the last pass) were
                    # freed above: their callers hear of it instead of waiting out their time.
                    self._has_returned = True
                    return
                submitted, self._submitted = self._submitted, []
                for request in submitted:
                    self.scheduler.add_request(request)
                output = self.scheduler.schedule()
                self._is_blocked = output.is_empty
            if not output.is_empty:
                self._execute(output)

    def _hand_back_memory(self) -> None:
        """Idle: the free blocks written since the last idle spell and keeping no prefix hand
        their pages back (`KVCache.release_pages`), so that the pool's memory follows the
        prompts in flight and the bounded prefix cache, not the largest burst since start;
        then the heap's free pages."""
        started = time.perf_counter()
        with self.lock:
            block_ids = self.scheduler.pool.take_written_free()
            # NOTE: under the lock (tens of ms for hundreds of MB, idle): a pass allocates
            # under it, and nothing reads or writes a free block.
            num_bytes = self.runner.kv_cache.release_pages(block_ids)
        if num_bytes:
            log.info(
                "idle_kv_memory_returned",
                num_blocks=len(block_ids),
                num_bytes=num_bytes,
                duration_ms=round((time.perf_counter() - started) * 1000, 1),
            )
        super()._hand_back_memory()

    def _execute(self, output: SchedulerOutput[Request]) -> None:
        scheduled = output.scheduled
        exports = [export for chunk in scheduled if (export := plan_export(chunk, self.block_size))]
        spans = chunk_spans(scheduled) if telemetry.is_enabled() else []
        now = time.monotonic()
        for chunk in scheduled:
            chunk.request.phases.mark_scheduled(now)
        started = time.perf_counter()
        try:
            self._import_stored_blocks(scheduled)
            scoring = [
                i for i, c in enumerate(scheduled) if c.request.sampling.prompt_logprobs is not None
            ]

            def ship_layer(layer: int) -> None:
                export_layer(
                    self.runner.kv_cache,
                    exports,
                    layer,
                    self.blocks_per_piece,
                    self.window_layers,
                )

            if scoring:
                logits, every_position = self.runner.execute_with_positions(
                    scheduled, ship_layer, scoring
                )
                for i in scoring:
                    _score_prompt(scheduled[i], every_position[i])
            else:
                logits = self.runner.execute(scheduled, ship_layer)
            completed, rows = self._sampling_rows(scheduled)
            tokens = self.sampler.sample(logits[completed], rows) if completed else []
        except Exception as error:
            for span in spans:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
                span.end()
            log.exception("prefill_pass_failed", error=str(error))
            with self.lock:
                self.scheduler.fail([c.request for c in scheduled])
            failed = EngineFailed(f"forward pass failed: {error}")
            if isinstance(error, TensorParallelError):
                # NOTE: the instance goes down (`InstanceServer`); the gloo error's words go
                # to the log above, the gateway gets a reason it retries elsewhere.
                failed = EngineFailed(
                    "the prefill instance lost a tensor-parallel rank and is going down",
                    ErrorReason.INSTANCE_DRAINING,
                )
            for chunk in scheduled:
                chunk.request.sink(failed)
            return
        self.num_passes += 1
        self.num_prompt_tokens += output.num_batched_tokens
        if self.metrics is not None:
            self.metrics.pass_seconds.observe(time.perf_counter() - started)
        for span in spans:
            span.end()
        for export in exports:
            export.request.num_sent_blocks = export.end_block
        with self.lock:
            self.scheduler.update_from_output(output)
        if self.store_loader is not None:
            for chunk in scheduled:
                first_block = chunk.num_computed_tokens // self.block_size
                end_block = chunk.request.num_computed_tokens // self.block_size
                self.store_loader.write_through(chunk.request, first_block, end_block)
        for i, picked in zip(completed, tokens, strict=True):
            request = scheduled[i].request
            if picked.token_id == NO_TOKEN:
                request.sink(EngineFailed(NO_TOKEN_DETAIL, ErrorReason.INVALID_REQUEST))
                continue
            request.sink(
                FirstTokenSampled(
                    picked.token_id,
                    time.monotonic(),
                    picked.logprobs,
                    tuple(request.prompt_logprobs),
                )
            )
        log.debug(
            "prefill_pass",
            num_requests=len(scheduled),
            num_batched_tokens=output.num_batched_tokens,
            num_first_tokens=len(completed),
        )

    def _sampling_rows(
        self, scheduled: list[ScheduledChunk[Request]]
    ) -> tuple[list[int], list[SamplingRow]]:
        """The indices in `scheduled` of the chunks that complete their prompt, and their
        rows; a request whose constraint refuses the completion it carries (a continuation's)
        fails alone (INVALID_REQUEST) and has no row."""
        completed, rows = [], []
        for i, chunk in enumerate(scheduled):
            if not chunk.completes_prompt:
                continue
            request = chunk.request
            try:
                rows.append(
                    SamplingRow.of_sequence(
                        request.sampling,
                        request.seed,
                        request.token_ids,
                        request.num_prompt_tokens,
                        request.constraint_state,
                    )
                )
            except PdserveError as error:
                request.sink(EngineFailed(error.message, error.reason))
                continue
            completed.append(i)
        return completed, rows

    def _import_stored_blocks(self, scheduled: list[ScheduledChunk[Request]]) -> None:
        """Copies the payloads admission took from the store into their blocks."""
        for chunk in scheduled:
            request = chunk.request
            if request.pending_imports:
                block_ids = [block_id for block_id, _ in request.pending_imports]
                payloads = [payload for _, payload in request.pending_imports]
                request.pending_imports = []
                import_block_payloads(self.runner.kv_cache, block_ids, payloads)


def _score_prompt(chunk: ScheduledChunk[Request], logits: torch.Tensor) -> None:
    """Adds the logprobs of the prompt tokens this chunk's positions predict to its request's
    prompt logprobs (the last prompt position predicts the first token: not a prompt token)."""
    request = chunk.request
    start = chunk.num_computed_tokens
    targets = request.token_ids[start + 1 : start + 1 + len(chunk.token_ids)]
    num_top = request.sampling.prompt_logprobs or 0
    request.prompt_logprobs.extend(token_logprobs(logits[: len(targets)], targets, num_top))
