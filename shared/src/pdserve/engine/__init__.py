"""pdserve's inference engine: a Llama-family model on a paged KV cache.

Layers, from the bottom up:

* ``ModelRunner.load(EngineConfig)`` loads the model and allocates ``runner.kv_cache``
  (``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``).
  ``runner.execute([ScheduledChunk(token_ids, num_computed_tokens, block_ids), ...],
  on_layer_done=callback)`` runs prefill chunks and decodes in one batch and returns the
  last-position logits of each chunk (``ScheduledChunk`` and ``SchedulerOutput``, in
  ``batch``, are what every scheduler hands the runner); ``callback(layer_index)`` fires as
  soon as a layer's KV for the batch is in the cache (layer-wise KV push from a prefill
  instance).
* ``KVCache.export_blocks(layer_index, block_ids)`` / ``import_blocks(layer_index, block_ids,
  k, v)`` move the bytes of blocks between processes.
* ``BlockPool`` (ids and reference counts), ``Sampler`` (tokens from logits, reproducible
  per seed and completion index).
* The colocated reference engine (``pdserve.engine.colocated``, run by no service):
  ``LLMEngine`` puts them together in one process (``add_request``, ``step``, ``abort``,
  ``generate``) with its own ``Scheduler`` (continuous batching), ``KVCacheManager`` (a
  request's blocks) and ``Request``.

``SamplingParams`` and ``FinishReason`` are the services' own (``pdserve.common.generation``),
re-exported here.

Names are imported lazily so that light modules of this package (e.g. the demo model
generator) can be imported without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.common.generation import FinishReason, SamplingParams
    from pdserve.engine.batch import ScheduledChunk, SchedulerOutput
    from pdserve.engine.block_pool import BlockPool, hash_block_tokens
    from pdserve.engine.colocated.engine import LLMEngine
    from pdserve.engine.colocated.kv_cache_manager import KVCacheManager
    from pdserve.engine.colocated.request import Request, RequestStatus
    from pdserve.engine.colocated.scheduler import RequestOutput, Scheduler
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.kv_cache import (
        KVBlockData,
        KVCache,
        KVCacheLayout,
        logical_blocks_touched,
    )
    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.runner import ModelRunner
    from pdserve.engine.sampler import Sampler, SamplingRow, position_seed

_EXPORTS = {
    "ScheduledChunk": "batch",
    "SchedulerOutput": "batch",
    "BlockPool": "block_pool",
    "hash_block_tokens": "block_pool",
    "CacheConfig": "config",
    "EngineConfig": "config",
    "SchedulerConfig": "config",
    "KVBlockData": "kv_cache",
    "KVCache": "kv_cache",
    "KVCacheLayout": "kv_cache",
    "logical_blocks_touched": "kv_cache",
    "KVCacheManager": "colocated.kv_cache_manager",
    "LLMEngine": "colocated.engine",
    "ModelConfig": "model_config",
    "FinishReason": "pdserve.common.generation",
    "Request": "colocated.request",
    "RequestStatus": "colocated.request",
    "ModelRunner": "runner",
    "Sampler": "sampler",
    "SamplingRow": "sampler",
    "position_seed": "sampler",
    "SamplingParams": "pdserve.common.generation",
    "RequestOutput": "colocated.scheduler",
    "Scheduler": "colocated.scheduler",
}

__all__ = [
    "BlockPool",
    "CacheConfig",
    "EngineConfig",
    "FinishReason",
    "KVBlockData",
    "KVCache",
    "KVCacheLayout",
    "KVCacheManager",
    "LLMEngine",
    "ModelConfig",
    "ModelRunner",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "Sampler",
    "SamplingParams",
    "SamplingRow",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "hash_block_tokens",
    "logical_blocks_touched",
    "position_seed",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not module.startswith("pdserve."):
        module = f"pdserve.engine.{module}"
    return getattr(importlib.import_module(module), name)
