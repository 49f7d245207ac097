"""A tensor-parallel rank other than 0, forked by `pdserve.engine.parallel.ranks`.

It reads its `Setup` from its pipe, joins the group, loads its share of the model, attaches to
the KV cache and then runs every `Step` rank 0 sends, discarding the logits (rank 0 samples).
It exits on `Shutdown`, at the end of its pipe (rank 0 is gone), or when a collective fails
(another rank is gone).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from multiprocessing.connection import Connection

import structlog
import torch
from torch.distributed import TCPStore

from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.parallel.group import LOOPBACK, RankShard, TensorParallelGroup
from pdserve.engine.parallel.layers import cache_head_range
from pdserve.engine.parallel.messages import Attach, Setup, Shutdown, Step
from pdserve.engine.parallel.shared_cache import attach_head_slice
from pdserve.engine.rank_model import cache_layout, load_rank_model
from pdserve.engine.runner import ModelRunner

log = structlog.get_logger(__name__)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the configured one on CPU, the device index plus r on CUDA."""
    device = torch.device(config.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _read(receive: Callable[[], object]) -> object:
    try:
        return receive()
    except EOFError:
        return Shutdown()


def serve_rank(pipe: Connection, env: dict[str, str]) -> None:
    """A rank's process: rank 0's environment (the fork server's was that of the process that
    started it; multiprocessing gives it rank 0's working directory), then `run` over `pipe`."""
    os.environ.clear()
    os.environ.update(env)
    run(pipe.recv)


def run(receive: Callable[[], object]) -> int:
    """Serves as the rank `Setup` names until shutdown; returns the exit status."""
    setup = _read(receive)
    if not isinstance(setup, Setup):
        return 0
    config = setup.config
    shard = RankShard(setup.rank, config.tensor_parallel_size)
    device = rank_device(config, setup.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout_s = config.tensor_parallel_timeout_s
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(LOOPBACK, setup.store_port, shard.world_size, False, timeout)
    group = TensorParallelGroup.form(store, shard, device, timeout_s)
    model = load_rank_model(config, device, group)
    attach = _read(receive)
    if not isinstance(attach, Attach):
        return 0
    heads = cache_head_range(model.config, shard)
    if attach.shared_path is not None:
        layout = cache_layout(config, model.config)
        kv_cache = attach_head_slice(
            attach.shared_path,
            layout,
            attach.num_blocks,
            heads,
            attach.window_layers,
            attach.num_window_slots,
        )
    else:
        layout = cache_layout(config, model.config, num_kv_heads=len(heads))
        kv_cache = KVCache(layout, attach.num_blocks, device)
    runner = ModelRunner(model, kv_cache)
    group.barrier()
    group.limit_waits(config.tensor_parallel_step_timeout_s)
    log.info("tensor_parallel_rank_ready", rank=shard.rank, world_size=shard.world_size)
    while True:
        message = _read(receive)
        if not isinstance(message, Step):
            return 0
        slots = kv_cache.window_slots
        if slots is not None:
            # NOTE: rank 0 holds the slot map; a step brings the slots of its blocks.
            for chunk, chunk_slots in zip(message.chunks, message.slots, strict=True):
                slots.slot_table[chunk.block_ids] = torch.tensor(chunk_slots, dtype=torch.long)
        try:
            runner.execute_with_positions(message.chunks, every_position=message.every_position)
        except ValueError as error:
            # NOTE: a batch prepare_step refuses is refused on every rank before any collective.
            log.warning("tensor_parallel_step_refused", rank=shard.rank, error=str(error))
