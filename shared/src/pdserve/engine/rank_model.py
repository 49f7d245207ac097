"""One rank's model and KV cache as an `EngineConfig` asks: the attention backend that runs,
the model loaded (the rank's share of it under tensor parallelism), the cache's layout and
size. A single-process `pdserve.engine.runner.ModelRunner` and every rank of
`pdserve.engine.parallel` load through here, so the runner needs nothing of the ranks'
package."""

from __future__ import annotations

from typing import NamedTuple

import structlog
import torch

from pdserve.common.generation import num_blocks_for
from pdserve.engine.batch_invariant import (
    INVARIANT_BACKEND,
    KEY_SPAN,
    MIN_ROWS,
    make_batch_invariant,
)
from pdserve.engine.config import EngineConfig
from pdserve.engine.cpu_kernels import TEAM_MAX_ROWS, set_team_threads, why_unavailable
from pdserve.engine.flash_attention import FLASH, flash_attn_unusable_reason
from pdserve.engine.kv_budget import size_kv_cache
from pdserve.engine.kv_cache import KVCacheLayout
from pdserve.engine.loader import load_model
from pdserve.engine.model import LlamaForCausalLM
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import TensorParallelGroup

log = structlog.get_logger(__name__)


def resolve_attention_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    deterministic: bool = False,
) -> str:
    """Turns ``auto``/``sdpa``/``flash`` into the backend that will actually run; under
    `deterministic`, SDPA's batch-invariant form (`pdserve.engine.batch_invariant`).

    Raises:
        ValueError: If ``flash`` is requested where it cannot run, or with `deterministic`.
    """
    reason = flash_attn_unusable_reason(device, dtype, block_size)
    if requested == "flash" and reason is not None:
        raise ValueError(f"attention_backend=flash is unusable: {reason}")
    if requested == "flash" and deterministic:
        raise ValueError("attention_backend=flash is not batch-invariant: drop --deterministic")
    backend = requested
    if deterministic:
        backend = INVARIANT_BACKEND
        reason = "batch-invariant numerics asked for (deterministic)"
    elif requested == "auto":
        backend = "flash" if reason is None else "sdpa"
    # NOTE: one line per model load says which attention runs, and on CUDA why not flash-attn.
    log.info(
        "attention_backend",
        backend=attention_backend_name(backend),
        requested=requested,
        device=str(device),
        flash_unusable=reason if device.type == "cuda" and backend == "sdpa" else None,
    )
    return backend


def load_rank_model(
    config: EngineConfig, device: torch.device, group: TensorParallelGroup | None = None
) -> LlamaForCausalLM:
    """Loads this rank's share of the model named by ``config`` onto `device` (the whole model
    without a group)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    if config.kernel_threads > 1:
        set_team_threads(config.kernel_threads)
        log.info(
            "kernel_team",
            threads=config.kernel_threads,
            max_rows=TEAM_MAX_ROWS,
            why_not=why_unavailable(torch.float32) and why_unavailable(torch.bfloat16),
        )
    model_config = ModelConfig.from_pretrained(config.model)
    choice = config.dtype_choice
    # NOTE: one line per model load says which dtype runs and why (auto depends on the CPU).
    log.info(
        "dtype_resolved",
        dtype=choice.dtype,
        requested=choice.requested,
        reason=choice.reason,
        cpu_bf16_flags=list(choice.cpu_bf16_flags),
        kv_dtype=str(config.cache_dtype).removeprefix("torch."),
        quantization=config.quantization,
    )
    backend = resolve_attention_backend(
        config.attention_backend,
        device,
        config.cache_dtype,
        config.cache.block_size,
        config.deterministic,
    )
    model = load_model(
        config.model,
        config.torch_dtype,
        device,
        backend,
        model_config,
        linear_backend=config.linear_backend,
        group=group,
        quantization=config.quantization,
    )
    if config.deterministic:
        projections, fixed_order = make_batch_invariant(model)
        # NOTE: one line per model load says that the numerics are batch-invariant.
        log.info(
            "batch_invariant",
            projections=projections,
            amx_projections=fixed_order,
            attention=backend,
            min_rows=MIN_ROWS,
            key_span=KEY_SPAN,
        )
    return model


def cache_layout(
    config: EngineConfig, model_config: ModelConfig, num_kv_heads: int | None = None
) -> KVCacheLayout:
    """The KV cache layout of the model: all its KV heads unless `num_kv_heads` says fewer."""
    return KVCacheLayout(
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=num_kv_heads or model_config.cache_num_kv_heads,
        head_dim=model_config.cache_head_dim,
        block_size=config.cache.block_size,
        dtype=str(config.cache_dtype).removeprefix("torch."),
    )


def num_cache_blocks(
    config: EngineConfig, model_config: ModelConfig, layout: KVCacheLayout, device: torch.device
) -> int:
    """How many blocks of `layout` the cache gets (`size_kv_cache`), logged."""
    limit = model_config.max_position_embeddings
    size = size_kv_cache(
        config.cache,
        layout,
        device,
        max_model_len=min(config.max_model_len or limit, limit),
        max_seqs=config.cache.max_seqs or config.scheduler.max_num_seqs,
    )
    log.info(
        "kv_cache_sized",
        source=size.source,
        num_blocks=size.num_blocks,
        block_size=layout.block_size,
        num_tokens=size.num_blocks * layout.block_size,
        bytes=size.num_blocks * layout.total_block_nbytes,
        available_bytes=size.available_bytes,
        fraction=size.fraction,
        device=str(device),
    )
    return size.num_blocks


class WindowCacheSize(NamedTuple):
    """A cache whose sliding layers keep only their window (`window_cache_size`)."""

    window_layers: tuple[int, ...]
    num_blocks: int
    num_window_slots: int


def window_cache_size(
    config: EngineConfig, model_config: ModelConfig, num_blocks: int
) -> WindowCacheSize | None:
    """The block ids and window slots that take the memory of `num_blocks` whole blocks when
    the sliding layers keep only their window (`CacheConfig.release_window_blocks`), or None
    (not asked, no sliding layer, several ranks on CUDA, or decode graphs).

    A sequence holds at most one step's chunk plus a window of slots, so the slots are what
    ``max_seqs`` such sequences hold (at most `num_blocks`); the memory they leave goes to more
    block ids for the full-attention layers (at most what ``max_seqs`` longest sequences hold).
    """
    num_layers = model_config.num_hidden_layers
    window_layers = model_config.window_layers
    if (
        not config.cache.release_window_blocks
        or not window_layers
        or (config.tensor_parallel_size > 1 and not config.device.startswith("cpu"))
        or config.uses_graphs
    ):
        return None
    block_size = config.cache.block_size
    window = model_config.widest_window
    max_seqs = config.cache.max_seqs or config.scheduler.max_num_seqs
    per_seq = num_blocks_for(window + config.scheduler.max_num_batched_tokens, block_size) + 1
    num_slots = max(1, min(num_blocks, max_seqs * per_seq))
    limit = model_config.max_position_embeddings
    max_ids = max_seqs * num_blocks_for(min(config.max_model_len or limit, limit), block_size)
    num_full = num_layers - len(window_layers)
    if num_full == 0:
        num_ids = max(num_blocks, max_ids)
    else:
        room = num_blocks * num_layers - num_slots * len(window_layers)
        num_ids = max(num_blocks, min(room // num_full, max(max_ids, num_blocks)))
    return WindowCacheSize(window_layers, num_ids, num_slots)


def attention_backend_name(backend: str) -> str:
    """What a resolved backend runs: ``sdpa``, ``flash-attn-4`` or ``flash-attn-2``."""
    if backend == "flash" and FLASH is not None:
        return FLASH.name
    return backend
