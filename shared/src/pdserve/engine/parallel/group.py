"""The process group of one tensor-parallel instance: its ranks and their collectives.

Rank 0 (the process that serves) opens a `torch.distributed.TCPStore` on a free loopback port
and the ranks it spawns join it; the group is a gloo process group on CPU and an NCCL one on
CUDA. The group is built directly on the store, not as torch's default group, so one process
may hold several instances' rank 0 (tests run a prefill and a decode in one process).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import TCPStore

LOOPBACK = "127.0.0.1"


class TensorParallelError(RuntimeError):
    """The tensor-parallel group could not form, or one of its ranks is gone."""


@dataclass(frozen=True)
class RankShard:
    """Which share of the model one rank holds.

    Attributes:
        rank: This rank, 0-based.
        world_size: Ranks in the instance (the tensor-parallel size).
    """

    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size <= 0 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a group of {self.world_size}")

    def num_kv_parts(self, num_kv_heads: int) -> int:
        """In how many distinct parts the KV heads are split: ``min(world_size, num_kv_heads)``
        (beyond that the heads are replicated)."""
        return min(self.world_size, num_kv_heads)

    def span(self, size: int) -> range:
        """This rank's contiguous share of `size` units; shares differ by at most one unit."""
        return range(self.rank * size // self.world_size, (self.rank + 1) * size // self.world_size)

    def kv_head_range(self, num_kv_heads: int) -> range:
        """The KV heads this rank holds: its share (uneven when the size does not divide
        them), or its replica of one head when there are more ranks than KV heads."""
        if self.world_size > num_kv_heads:
            part = self.rank * num_kv_heads // self.world_size
            return range(part, part + 1)
        return self.span(num_kv_heads)

    def q_head_range(self, num_heads: int, num_kv_heads: int) -> range:
        """The query heads this rank holds: those that read its KV heads (GQA groups stay
        whole), or its share of one replicated KV head's group."""
        if self.world_size > num_kv_heads:
            return self.span(num_heads)
        kv = self.kv_head_range(num_kv_heads)
        group = num_heads // num_kv_heads
        return range(kv.start * group, kv.stop * group)

    def vocab_range(self, vocab_size: int) -> range:
        """The rows of the embedding and LM head this rank holds (the last may be short)."""
        per_rank = -(-vocab_size // self.world_size)
        start = min(self.rank * per_rank, vocab_size)
        return range(start, min(start + per_rank, vocab_size))

    def vocab_per_rank(self, vocab_size: int) -> int:
        """Rows per rank of the vocabulary-parallel matrices (padded equal across ranks)."""
        return -(-vocab_size // self.world_size)


def check_divisible(shard: RankShard, num_heads: int, num_kv_heads: int) -> None:
    """Refuses a tensor-parallel size the attention heads cannot be split over.

    Up to the number of KV heads any size works: each rank takes whole KV heads with their
    query heads, some ranks one head more than others (SmolLM2's 3 KV heads over 2 ranks:
    2 and 1). Beyond it the KV heads are replicated, which needs whole replicas and an even
    split of each head's query group.

    Raises:
        ValueError: If the size exceeds the KV heads without being a multiple of them, or the
            query heads do not divide by it then.
    """
    size = shard.world_size
    if size <= num_kv_heads:
        return
    if size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} is more than the {num_kv_heads} KV heads and not a "
            "multiple of them"
        )
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide {num_heads} query heads")


class TensorParallelGroup:
    """One rank's handle on its instance's group, with the collectives the model runs.

    A group of one (`TensorParallelGroup.single()`) runs no collectives: the model code calls
    them unconditionally.

    Args:
        shard: This rank and the group's size.
        process_group: The gloo or NCCL group (``ProcessGroupGloo``/``ProcessGroupNCCL``,
            which torch's stubs type apart); None for a group of one.
        device: This rank's device (where the collectives' tensors live).
    """

    def __init__(
        self,
        shard: RankShard,
        process_group: Any,
        device: torch.device | None = None,
    ) -> None:
        self.shard = shard
        self.process_group = process_group
        self.device = device or torch.device("cpu")

    @classmethod
    def single(cls) -> TensorParallelGroup:
        """The group of an instance without tensor parallelism."""
        return cls(RankShard(), None)

    @classmethod
    def form(
        cls, store: TCPStore, shard: RankShard, device: torch.device, timeout_s: float
    ) -> TensorParallelGroup:
        """Joins the group over `store`, waiting at most `timeout_s` for every rank.

        Raises:
            TensorParallelError: If not every rank joined within `timeout_s`.
        """
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if device.type == "cuda":
                options = torch.distributed.ProcessGroupNCCL.Options()
                options._timeout = timeout
                group: Any = torch.distributed.ProcessGroupNCCL(
                    store, shard.rank, shard.world_size, options
                )
            else:
                gloo = torch.distributed.ProcessGroupGloo
                options = gloo._Options()  # type: ignore[attr-defined]
                options._timeout = timeout
                options._devices = [gloo.create_device(hostname=LOOPBACK)]
                group = gloo(store, shard.rank, shard.world_size, options)
        except (RuntimeError, torch.distributed.DistError) as error:
            raise TensorParallelError(
                f"the tensor-parallel group of {shard.world_size} ranks did not form within "
                f"{timeout_s:g}s (rank {shard.rank}): {error}"
            ) from None
        return cls(shard, group, device)

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world_size(self) -> int:
        return self.shard.world_size

    def limit_waits(self, timeout_s: float) -> None:
        """From now on a collective waits at most `timeout_s` for the other ranks (set once
        the ranks loaded: loading may keep one waiting far longer than a step)."""
        if self.process_group is not None:
            self.process_group._set_default_timeout(datetime.timedelta(seconds=timeout_s))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks in place (a row-parallel projection's partial products)."""
        if self.process_group is not None:
            self.process_group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's `x` along its last dimension, in rank order.

        ``[..., n]`` on each rank -> ``[..., world_size * n]``.
        """
        if self.process_group is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.process_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def barrier(self) -> None:
        """Returns once every rank has reached it (a one-element all-reduce)."""
        if self.process_group is not None:
            self.all_reduce(torch.zeros(1, device=self.device))
