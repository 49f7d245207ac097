"""Settings of a prefill instance: one frozen dataclass that also defines the CLI flags."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config import port_setting, setting
from pdserve.common.grpc_server import MAX_MESSAGE_BYTES
from pdserve.serving.config import InstanceConfig, transport_list

DEFAULT_PORT = 50060
KV_TRANSPORTS = ("nixl", "cuda_ipc", "shm", "tcp", "grpc")


@dataclass(frozen=True)
class PrefillConfig(InstanceConfig):
    """Configuration of `pdserve-prefill`. Field help texts are the CLI's ``--help``."""

    port: int = port_setting(DEFAULT_PORT, "gRPC port; 0 picks a free port")
    num_blocks: int | None = setting(
        None,
        "KV cache blocks of this prefill (prompts being computed or shipped, and "
        "the prefix cache); when unset, what --kv-cache-memory-mb holds, or sized from "
        "free memory without it",
    )
    max_num_batched_tokens: int = setting(
        2048,
        "token budget of one forward pass: several prompts share a pass, longer "
        "prompts are chunked across passes",
        gt=0,
    )
    max_queue_len: int = setting(
        256,
        "most requests held at once (preparing, queued, computing or shipping); "
        "beyond it Prefill answers PREFILL_OVERLOADED",
        gt=0,
    )
    prepare_concurrency: int = setting(
        8,
        "most AllocateBlocks calls in flight to one decode instance; requests for "
        "other decodes never wait for these slots",
        gt=0,
    )
    allocate_timeout_ms: int = setting(
        5000,
        "how long a request may wait for its decode's lease (slot wait included) "
        "before it fails with PEER_UNAVAILABLE",
        gt=0,
    )
    lease_window_tokens: int | None = setting(
        None,
        "most prompt tokens still to compute of the requests that hold (or ask "
        "for) a decode lease here; the next request waits in line, holding nothing of its "
        "decode's, until earlier prompts are computed, so a lease's TTL runs only near its "
        "prompt's turn (the first in line always gets in); unset: twice "
        "--max-num-batched-tokens; 0: no bound (every request takes its lease on arrival)",
        min=0,
    )
    prefix_cache: bool = setting(
        True,
        "keep the full blocks of finished prompts as an evictable prefix cache and "
        "compute only what follows the longest cached prefix of a new prompt",
    )
    # NOTE: 4,096 tokens (94 MB of the default model's KV) keeps the system prompts and the
    # latest conversations while the pool's untouched blocks stay unwritten. It needs the lease
    # window: without it, 60 long prompts sent at once failed 34 of 60 with this bound (their
    # leases expired while earlier prompts were computed, and their retries found nothing
    # cached).
    prefix_cache_max_tokens: int = setting(
        4096,
        "most prompt tokens the prefix cache keeps once their requests have left "
        "(whole blocks); past it the least recently freed are forgotten and their blocks "
        "written again first, so this prefill's memory holds the prompts in flight and "
        "this much however many blocks it has; larger keeps more prompts (as many tokens "
        "as the pool holds: every free block, the whole pool written in time), at their "
        "KV's memory",
        min=0,
    )
    kv_transports: str = setting(
        "cuda_ipc,shm,nixl,tcp,grpc",
        "KV transports this prefill may use, comma-separated in order of "
        "preference, among those its decode offers: nixl (one-sided NIXL WRITEs into the "
        "decode's registered KV cache over UCX: shared memory or TCP on CPU hosts, CUDA IPC, "
        "NVLink or RDMA between GPUs; where the nixl extra is installed), cuda_ipc (copy "
        "device to device into the decode's CUDA KV cache, same host and GPU kind), shm "
        "(write into the decode's shared-memory KV cache, same host), tcp (the decode's "
        "data port), grpc (SyncCache, always offered). One that cannot be opened falls back "
        "to the next; listing one forces it",
    )
    max_chunk_bytes: int = setting(
        1 << 20, "most K+V bytes per SyncCache chunk (one layer's run of blocks)", gt=0
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.kv_transport_kinds  # NOTE: a bad list is refused at start, not at first use
        # NOTE: a chunk also carries its header fields; keep the K+V payload well inside the
        # channels' message limit.
        if self.max_chunk_bytes > MAX_MESSAGE_BYTES // 2:
            raise ValueError(
                f"max_chunk_bytes must be <= {MAX_MESSAGE_BYTES // 2} (half the gRPC message "
                f"limit), got {self.max_chunk_bytes}"
            )

    @property
    def kv_transport_kinds(self) -> tuple[str, ...]:
        """The transports this prefill may use, in order of preference."""
        return transport_list(self.kv_transports, KV_TRANSPORTS, at_least_one=True)

    @property
    def lease_window_bound(self) -> int | None:
        """The lease window's bound in tokens; None: no bound."""
        if self.lease_window_tokens is None:
            return 2 * self.max_num_batched_tokens
        return self.lease_window_tokens or None

    @property
    def kv_cache_max_seqs(self) -> int | None:
        # NOTE: every request held keeps its whole prompt's blocks until its KV is shipped.
        return self.max_queue_len
