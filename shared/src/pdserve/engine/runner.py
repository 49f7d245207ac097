"""Runs batches of sequence chunks through the model on the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import structlog
import torch

from pdserve.engine.attention_buffer import KVGatherBuffer
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.config import EngineConfig
from pdserve.engine.graphs.capture import CaptureBackend
from pdserve.engine.graphs.runner import GraphRunner, build_graph_runner
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model import LayerCallback, LlamaForCausalLM
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.rank_model import (
    attention_backend_name,
    cache_layout,
    load_rank_model,
    num_cache_blocks,
    window_cache_size,
)
from pdserve.engine.step_inputs import prepare_step

log = structlog.get_logger(__name__)


def _batch_position(chunk: ScheduledChunk[Any]) -> tuple[bool, int]:
    is_decode = len(chunk.token_ids) == 1
    return (not is_decode, chunk.num_computed_tokens if is_decode else 0)


class ModelRunner:
    """Executes forward passes; owns the model and the KV cache (not the block bookkeeping).

    Args:
        model: A loaded model.
        kv_cache: The paged cache the model reads and writes.
    """

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        self.model = model
        self.attention_backend = attention_backend_name(model.attention_backend)
        """What attention runs: ``sdpa``, ``flash-attn-4`` or ``flash-attn-2``."""
        self.kv_cache = kv_cache
        self.rank_cache = kv_cache
        """The cache this rank's share of the model attends over: `kv_cache`, or on a
        tensor-parallel rank a view of its heads in it."""
        self.model_config: ModelConfig = model.config
        self.block_size = kv_cache.block_size
        self.device = kv_cache.device
        self.gather_buffer = KVGatherBuffer()
        self.graphs: GraphRunner | None = None
        """Replays decode steps once captured (`capture_graphs`); None: every step is eager."""

    @classmethod
    def load(cls, config: EngineConfig) -> ModelRunner:
        """Loads the model named by ``config`` on this one rank and allocates its KV cache
        (`pdserve.engine.load_runner.load_runner` also loads a tensor-parallel instance).

        Raises:
            ValueError: ``config.tensor_parallel_size`` is above one.
        """
        if config.tensor_parallel_size > 1:
            raise ValueError(
                "a tensor-parallel instance loads with pdserve.engine.load_runner.load_runner"
            )
        device = torch.device(config.device)
        model = load_rank_model(config, device)
        layout = cache_layout(config, model.config)
        num_blocks = num_cache_blocks(config, model.config, layout, device)
        window = window_cache_size(config, model.config, num_blocks)
        if window is None:
            kv_cache = KVCache(layout, num_blocks, device)
        else:
            kv_cache = KVCache(
                layout, window.num_blocks, device, window_layers=window.window_layers,
                num_window_slots=window.num_window_slots,
            )  # fmt: skip
            log.info(
                "kv_cache_windowed",
                window_layers=len(window.window_layers),
                num_layers=layout.num_layers,
                num_blocks=window.num_blocks,
                num_window_slots=window.num_window_slots,
                bytes=kv_cache.nbytes,
            )
        runner = cls(model, kv_cache)
        if config.uses_graphs:
            limit = model.config.max_position_embeddings
            runner.capture_graphs(
                config.cache.max_seqs or config.scheduler.max_num_seqs,
                min(config.max_model_len or limit, limit),
            )
        return runner

    def capture_graphs(
        self, max_num_seqs: int, max_model_len: int, capture: CaptureBackend | None = None
    ) -> bool:
        """Captures the decode step per batch-size bucket (`pdserve.engine.graphs`); from then
        on a decode-only batch that fits a bucket replays. Call before any KV is cached.

        Args:
            max_num_seqs: Most sequences of a decode step (the largest bucket).
            max_model_len: The longest sequence served.
            capture: How to capture; CUDA graphs on CUDA, a stand-in that reruns the step
                on CPU (tests).

        Returns:
            Whether graphs were captured (not for an attention backend without a graph path,
            or when the capture failed; both logged).
        """
        if self.kv_cache.window_slots is not None:
            log.info("decode_graphs_skipped", detail="the sliding layers read through slots")
            return False
        self.graphs = build_graph_runner(
            self.model, self.rank_cache, self.attention_backend, max_num_seqs, max_model_len,
            capture,
        )  # fmt: skip
        return self.graphs is not None

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks the model is split over (one here; see `TensorParallelRunner`)."""
        return 1

    def close(self) -> None:
        """Releases what the runner holds besides memory (a tensor-parallel runner's ranks)."""

    def watch_ranks(self, callback: Callable[[int, int], None]) -> None:
        """Calls ``callback(rank, exit_status)`` from another thread if a rank of the instance
        exits unexpectedly (never for a single-process runner)."""

    def execute(
        self, chunks: Sequence[ScheduledChunk[Any]], on_layer_done: LayerCallback | None = None
    ) -> torch.Tensor:
        """Runs one batch: writes every chunk's KV into its blocks and returns next-token logits
        (`execute_with_positions` without its every-position logits)."""
        return self.execute_with_positions(chunks, on_layer_done)[0]

    @torch.inference_mode()
    def execute_with_positions(
        self,
        chunks: Sequence[ScheduledChunk[Any]],
        on_layer_done: LayerCallback | None = None,
        every_position: Collection[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Runs one batch: writes every chunk's KV into its blocks and returns next-token logits.

        Sequences may start anywhere (chunked prefill on top of cached KV); a chunk of one token
        is a decode. Chunks are independent: a chunk's result does not depend on the others.

        Args:
            chunks: The sequences of the batch; no two may share a block they write to.
            on_layer_done: Called with each layer index as soon as that layer's KV for the whole
                batch is in the cache, so a sender can ship it while later layers compute. On
                CUDA the write is enqueued, not finished: order any copy on the same stream.
            every_position: Indices of the chunks whose every position's logits are wanted
                (prompt logprobs), not only their last one's.

        Returns:
            ``[len(chunks), vocab_size]`` float32 logits of the last token of each chunk, and
            for each chunk index in `every_position` its ``[num_new_tokens, vocab_size]``
            logits (row j predicts the token after its j-th new token).
        """
        if not chunks:
            raise ValueError("execute needs at least one chunk")
        # NOTE: decode-only batches up to the largest bucket replay a captured step; the rest
        # (prefill chunks, mixed steps, larger batches, long contexts) run eagerly.
        graphs = None if on_layer_done or every_position else self.graphs
        if graphs is not None and graphs.bucket_of(chunks) is not None:
            return graphs.run(chunks), {}
        # NOTE: decodes first, shortest context first, so that similar lengths attend together.
        order = sorted(range(len(chunks)), key=lambda i: _batch_position(chunks[i]))
        input_ids, positions, metadata = prepare_step(
            [chunks[i] for i in order], self.block_size, self.device, self.gather_buffer
        )
        last_rows = torch.cumsum(metadata.query_lens, 0) - 1
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        # NOTE: on the device before the forward is queued, so no copy waits for it.
        # rows: [2, num_seqs]: each chunk's last token row; each chunk's place in the batch
        rows = torch.stack([last_rows, inverse]).to(self.device)
        hidden = self.model(input_ids, positions, self.rank_cache, metadata, on_layer_done)
        logits_sorted = self.model.compute_logits(hidden[rows[0]])
        every: dict[int, torch.Tensor] = {}
        if every_position:
            ends = torch.cumsum(metadata.query_lens, 0).tolist()
            for index in every_position:
                position = int(inverse[index])
                start = ends[position] - int(metadata.query_lens[position])
                every[index] = self.model.compute_logits(hidden[start : ends[position]])
        return logits_sorted[rows[1]], every
