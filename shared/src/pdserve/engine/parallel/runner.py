"""Rank 0's runner: the same interface as `ModelRunner`, each step run by every rank.

`TensorParallelRunner.load` starts ranks 1..N-1 (`pdserve.engine.parallel.worker`), forms the
group with them, loads rank 0's share of the model and creates the KV cache (on CPU one
shared file of all heads, `pdserve.engine.parallel.shared_cache`). Each `execute` sends the
batch to the other ranks, then runs rank 0's share; the ranks meet in the collectives of
every layer. The colocated engine, the prefill and the decode use it unchanged.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Collection, Sequence
from typing import Any

import structlog
import torch
from torch.distributed import TCPStore

from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.model import LayerCallback, LlamaForCausalLM
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import (
    LOOPBACK,
    RankShard,
    TensorParallelError,
    TensorParallelGroup,
)
from pdserve.engine.parallel.layers import cache_head_range, check_model_fits
from pdserve.engine.parallel.messages import Attach, Setup, Step
from pdserve.engine.parallel.ranks import RankProcesses
from pdserve.engine.parallel.shared_cache import (
    create_shared_cache,
    head_slice,
    remove_shared_cache,
)
from pdserve.engine.parallel.worker import rank_device
from pdserve.engine.rank_model import (
    cache_layout,
    load_rank_model,
    num_cache_blocks,
    window_cache_size,
)
from pdserve.engine.runner import ModelRunner

log = structlog.get_logger(__name__)


class TensorParallelRunner(ModelRunner):
    """Rank 0 of a tensor-parallel instance.

    Args:
        model: Rank 0's share of the model.
        kv_cache: The cache rank 0 sees: all heads on CPU (shared with the ranks), its own
            heads on CUDA.
        group: The instance's group.
        ranks: The processes of the other ranks.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        group: TensorParallelGroup,
        ranks: RankProcesses,
    ) -> None:
        super().__init__(model, kv_cache)
        self.group = group
        self.ranks = ranks
        if kv_cache.shared_path is not None:
            self.rank_cache = head_slice(kv_cache, cache_head_range(model.config, group.shard))

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks the model is split over."""
        return self.group.world_size

    @classmethod
    def load(cls, config: EngineConfig) -> TensorParallelRunner:
        """Starts the other ranks, forms the group, loads rank 0's share and the KV cache.

        Raises:
            TensorParallelError: If the group does not form within
                ``config.tensor_parallel_timeout_s``, or a rank is lost while loading.
            ValueError: If the model cannot be split over ``config.tensor_parallel_size``.
        """
        size = config.tensor_parallel_size
        # NOTE: refused here, before any rank starts, rather than by every rank's loader.
        check_model_fits(
            ModelConfig.from_pretrained(config.model), TensorParallelGroup(RankShard(0, size), None)
        )
        timeout_s = config.tensor_parallel_timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        store = TCPStore(LOOPBACK, 0, size, True, timeout, wait_for_workers=False)
        ranks = RankProcesses(size)
        kv_cache: KVCache | None = None
        try:
            for rank in range(1, size):
                ranks.send(Setup(config, rank, store.port), rank)
            device = rank_device(config, 0)
            group = TensorParallelGroup.form(store, RankShard(0, size), device, timeout_s)
            model = load_rank_model(config, device, group)
            layout = cache_layout(config, model.config)
            window = None
            if device.type == "cpu":
                num_blocks = num_cache_blocks(config, model.config, layout, device)
                window = window_cache_size(config, model.config, num_blocks)
                if window is None:
                    kv_cache = create_shared_cache(layout, num_blocks)
                else:
                    num_blocks = window.num_blocks
                    kv_cache = create_shared_cache(
                        layout,
                        num_blocks,
                        window_layers=window.window_layers,
                        num_window_slots=window.num_window_slots,
                    )
            else:
                heads = cache_head_range(model.config, group.shard)
                layout = cache_layout(config, model.config, num_kv_heads=len(heads))
                num_blocks = num_cache_blocks(config, model.config, layout, device)
                kv_cache = KVCache(layout, num_blocks, device)
            ranks.send(
                Attach(num_blocks, kv_cache.shared_path)
                if window is None
                else Attach(
                    num_blocks,
                    kv_cache.shared_path,
                    window.window_layers,
                    window.num_window_slots,
                )
            )
            group.barrier()
            group.limit_waits(config.tensor_parallel_step_timeout_s)
        except BaseException:
            ranks.close(timeout_s=1.0)
            if kv_cache is not None:
                remove_shared_cache(kv_cache)
            raise
        log.info("tensor_parallel_ready", world_size=size, pids=ranks.pids())
        return cls(model, kv_cache, group, ranks)

    @torch.inference_mode()
    def execute_with_positions(
        self,
        chunks: Sequence[ScheduledChunk[Any]],
        on_layer_done: LayerCallback | None = None,
        every_position: Collection[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """`ModelRunner.execute_with_positions`, run by every rank.

        Raises:
            TensorParallelError: If a rank is lost (before or during the step); every later
                step raises it too.
        """
        slots = self.kv_cache.window_slots
        self.ranks.send(
            Step.of(chunks, sorted(every_position), None if slots is None else slots.slot_table)
        )
        try:
            return super().execute_with_positions(chunks, on_layer_done, every_position)
        except RuntimeError as error:
            if isinstance(error, TensorParallelError):
                raise
            # NOTE: a collective fails at once when a peer's connection closes.
            self.ranks.check_alive()
            # NOTE: every rank still runs, so one did not answer in time (frozen, wedged): it
            # is taken as lost like a dead one (its watchers take the instance down).
            self.ranks.abandon()
            raise TensorParallelError(
                f"a tensor-parallel rank did not answer within the step timeout: {error}"
            ) from error

    def watch_ranks(self, callback: Callable[[int, int], None]) -> None:
        """See `ModelRunner.watch_ranks`."""
        self.ranks.on_rank_lost.append(callback)

    def close(self) -> None:
        """Stops the other ranks and removes the shared cache file."""
        self.ranks.close()
        remove_shared_cache(self.kv_cache)
