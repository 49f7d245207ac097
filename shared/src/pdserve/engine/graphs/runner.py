"""`GraphRunner`: decode steps replayed from one capture per batch-size bucket."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import structlog
import torch

from pdserve.common.generation import num_blocks_for
from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.graphs.buckets import bucket_for, bucket_sizes
from pdserve.engine.graphs.buffers import StaticDecodeBuffers
from pdserve.engine.graphs.capture import CaptureBackend, Step, default_capture
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model import LlamaForCausalLM

log = structlog.get_logger(__name__)


class CaptureReport(NamedTuple):
    """What capturing cost.

    Attributes:
        buckets: The batch sizes captured, ascending.
        seconds: Wall time of every capture (warm-ups included).
        memory_bytes: Device memory the graphs took (0 for the stand-in).
        max_context_len: The longest context a graph step attends over.
    """

    buckets: tuple[int, ...]
    seconds: float
    memory_bytes: int
    max_context_len: int


class GraphRunner:
    """Runs decode-only batches of up to the largest bucket by replaying a captured step.

    A batch is copied into the static buffers (`StaticDecodeBuffers.fill`), padded to the
    smallest bucket that holds it, and that bucket's capture replays: the embeddings, every
    layer (K/V written into the cache, attention over it) and the logits. What a graph cannot
    run, the caller runs eagerly (`can_run`).

    Args:
        model: The loaded model.
        kv_cache: The cache it attends over (this rank's view of it).
        max_num_seqs: Most sequences of a decode step (the largest bucket).
        max_context_len: The longest context a graph step attends over; longer ones run
            eagerly.
        capture: How steps are captured; CUDA graphs on CUDA, the stand-in elsewhere.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_context_len: int,
        capture: CaptureBackend | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = bucket_sizes(max_num_seqs)
        self.buffers = StaticDecodeBuffers(
            max_rows=self.buckets[-1],
            max_blocks_per_seq=num_blocks_for(max_context_len, kv_cache.block_size),
            block_size=kv_cache.block_size,
            vocab_size=model.config.vocab_size,
            device=kv_cache.device,
        )
        self.capture_backend = capture or default_capture(kv_cache.device)
        self._replays: dict[int, Step] = {}
        self.num_replays = 0

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Captures one step per bucket, the largest first, and logs ``cuda_graphs_captured``.

        NOTE: capturing runs the step (warm-ups, or the stand-in's one run) on padding rows,
        which write row 0's K/V into slot 0 of block 0: call it before any KV is cached.
        """
        started = time.perf_counter()
        for bucket in reversed(self.buckets):
            self.buffers.fill_padding(bucket)
            step = self._step(bucket, self.buffers.metadata(bucket))
            self._replays[bucket] = self.capture_backend.capture(step)
        report = CaptureReport(
            buckets=self.buckets,
            seconds=time.perf_counter() - started,
            memory_bytes=self.capture_backend.memory_bytes(),
            max_context_len=self.buffers.max_context_len,
        )
        log.info(
            "cuda_graphs_captured",
            buckets=list(report.buckets),
            capture_s=round(report.seconds, 3),
            memory_bytes=report.memory_bytes,
            max_context_len=report.max_context_len,
            capture=type(self.capture_backend).__name__,
        )
        return report

    def _step(self, num_rows: int, metadata: AttentionMetadata) -> Step:
        buffers = self.buffers

        def step() -> None:
            # NOTE: the memo holds tensors derived from the buffers (the mask); a CUDA graph
            # recomputes them at each replay, the stand-in must not reuse a stale one.
            metadata.derived.clear()
            # hidden: [num_rows, hidden_size]
            hidden = self.model(
                buffers.input_ids[:num_rows], buffers.positions[:num_rows], self.kv_cache, metadata
            )
            buffers.logits[:num_rows].copy_(self.model.compute_logits(hidden))

        return step

    def bucket_of(self, chunks: Sequence[ScheduledChunk[Any]]) -> int | None:
        """The bucket a batch replays in, or None when it must run eagerly (a prefill chunk, a
        context past the graphs' longest, more sequences than the largest bucket)."""
        if not self._replays or not all(self.buffers.fits(chunk) for chunk in chunks):
            return None
        return bucket_for(len(chunks), self.buckets)

    def run(self, chunks: Sequence[ScheduledChunk[Any]]) -> torch.Tensor:
        """Runs a batch that has a bucket (`bucket_of`); returns ``[len(chunks), vocab]``
        float32 logits in the order of `chunks`.

        Raises:
            ValueError: If the batch has no bucket.
        """
        bucket = self.bucket_of(chunks)
        if bucket is None:
            raise ValueError(f"a batch of {len(chunks)} has no captured decode step")
        self.buffers.fill(chunks, bucket)
        self._replays[bucket]()
        self.num_replays += 1
        # NOTE: a copy: the next replay overwrites the buffer while the caller may still read.
        return self.buffers.logits[: len(chunks)].clone()


SDPA_MAX_CONTEXT_LEN = 2048
"""The longest context a graph step attends over with SDPA, which reads the whole table width
of every row each step (a paged kernel reads only each row's context)."""


def build_graph_runner(
    model: LlamaForCausalLM,
    kv_cache: KVCache,
    attention_backend: str,
    max_num_seqs: int,
    max_model_len: int,
    capture: CaptureBackend | None = None,
) -> GraphRunner | None:
    """A `GraphRunner` with every bucket captured, or None (logged) where the model's decode
    cannot be captured: an attention backend with no graph path, or a failed capture.

    Args:
        attention_backend: What the model's attention runs (``sdpa``, ``flash-attn-2``, ...).
        max_model_len: The longest sequence served.
    """
    from pdserve.engine.flash_attention import GRAPH_CAPTURABLE

    if attention_backend != "sdpa" and attention_backend not in GRAPH_CAPTURABLE:
        log.warning(
            "cuda_graphs_skipped",
            attention_backend=attention_backend,
            reason="this attention backend has no graph-capturable decode",
        )
        return None
    max_context_len = max_model_len
    if attention_backend == "sdpa":
        max_context_len = min(max_model_len, SDPA_MAX_CONTEXT_LEN)
    runner = GraphRunner(model, kv_cache, max_num_seqs, max_context_len, capture)
    try:
        runner.capture()
    except Exception as error:  # pragma: no cover - a model whose forward reads the host
        # NOTE: e.g. the expert routing of a mixture-of-experts model, which counts tokens per
        # expert on the host: a capture cannot sync, so that model decodes eagerly.
        log.warning("cuda_graphs_skipped", attention_backend=attention_backend, reason=repr(error))
        return None
    return runner
