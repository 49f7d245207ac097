"""Plain descriptions of prefill and decode instances: identity, KV layout and load."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.common.protocol import kv_layout_fingerprint


class InstanceRole(enum.Enum):
    """What an instance does in a cluster."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class KvLayout:
    """Shape and identity of an instance's paged KV cache (see KvLayout in common.proto).

    Attributes:
        dtype: The KvDtype value name, e.g. ``"KV_DTYPE_FLOAT32"``.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    fingerprint: str

    @property
    def is_fingerprint_valid(self) -> bool:
        """Whether `fingerprint` is the contract's hash of the other fields."""
        expected = kv_layout_fingerprint(
            self.model_id,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.block_size,
        )
        return self.fingerprint == expected


@dataclass(frozen=True)
class InstanceInfo:
    """Who an instance is and how to reach it."""

    instance_id: str
    role: InstanceRole
    address: str
    protocol_version: str
    features: tuple[str, ...]
    kv_layout: KvLayout
    model_name: str
    max_model_len: int
    metrics_address: str = ""
    batch_invariant: bool = False


@dataclass(frozen=True)
class LoadReport:
    """A snapshot of an instance's load (see LoadReport in common.proto)."""

    num_queued_prompt_tokens: int = 0
    num_queued_requests: int = 0
    num_running_requests: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_leased_blocks: int = 0
    num_reserved_blocks: int = 0
    is_draining: bool = False
    max_cached_blocks: int | None = None  # None: not reported (the whole pool may cache)

    @property
    def num_admissible_blocks(self) -> int:
        """Free blocks after the headroom owed to running requests (decode admission)."""
        return max(0, self.num_free_blocks - self.num_reserved_blocks)
