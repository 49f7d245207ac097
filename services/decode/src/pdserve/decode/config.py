"""Settings of a decode instance: one frozen dataclass that also defines the CLI flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.serving.config import InstanceConfig

DEFAULT_PORT = 50070
KV_TRANSPORTS = ("shm", "tcp")


@dataclass(frozen=True)
class DecodeConfig(InstanceConfig):
    """Configuration of `pdserve-decode`. Field help texts are the CLI's ``--help``."""

    port: int = field(default=DEFAULT_PORT, metadata={"help": "gRPC port; 0 picks a free port"})
    max_num_seqs: int = field(
        default=64, metadata={"help": "most requests decoded together in one step"}
    )
    reserve_tokens: int = field(
        default=32,
        metadata={
            "help": "growth headroom (tokens) kept free per running request; new leases are "
            "admitted only from blocks beyond it"
        },
    )
    lease_ttl_ms: int = field(
        default=30_000,
        metadata={"help": "a lease not committed and attached within this time is reclaimed"},
    )
    capacity_retry_ms: int = field(
        default=200, metadata={"help": "retry delay suggested with DECODE_CAPACITY_EXHAUSTED"}
    )
    max_lease_share: float = field(
        default=0.5,
        metadata={
            "help": "fraction of the KV pool one prefill may hold in leases not yet committed "
            "while other prefills ask for blocks too; more is refused with "
            "DECODE_CAPACITY_EXHAUSTED (the prefill waits and asks again), except a prefill's "
            "only uncommitted lease"
        },
    )
    kv_transports: str = field(
        default="shm,tcp",
        metadata={
            "help": "KV transports offered to prefills besides gRPC SyncCache (always offered), "
            "comma-separated in order of preference: shm (the KV cache in a shared-memory "
            "segment that a prefill on this host writes into) and tcp (a raw TCP data port); "
            "both need a CPU KV cache; empty offers gRPC only"
        },
    )
    kv_tcp_port: int = field(
        default=0,
        metadata={"help": "port of the TCP KV data port (bound on --host); 0 picks a free port"},
    )
    kv_offload_wait_ms: int = field(
        default=1000,
        metadata={
            "help": "with --kv-store, how long a preemption notice waits for the offload of "
            "the request's blocks; a notice sent before the write landed carries no key (the "
            "reschedule recomputes those blocks)"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_offload_wait_ms < 0:
            raise ValueError(f"kv_offload_wait_ms must be >= 0, got {self.kv_offload_wait_ms}")
        for name in ("max_num_seqs", "lease_ttl_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {self.reserve_tokens}")
        if not 0 < self.max_lease_share <= 1:
            raise ValueError(f"max_lease_share must be in (0, 1], got {self.max_lease_share}")
        unknown = set(self.kv_transport_kinds) - set(KV_TRANSPORTS)
        if unknown:
            raise ValueError(
                f"kv_transports: unknown {', '.join(sorted(unknown))} (choose from "
                f"{', '.join(KV_TRANSPORTS)}; gRPC is always offered)"
            )
        if not 0 <= self.kv_tcp_port < 65536:
            raise ValueError(f"kv_tcp_port must be in 0..65535, got {self.kv_tcp_port}")
        if self.capacity_retry_ms < 0:
            raise ValueError(f"capacity_retry_ms must be >= 0, got {self.capacity_retry_ms}")

    @property
    def kv_transport_kinds(self) -> tuple[str, ...]:
        """The offered transports besides gRPC, in order of preference."""
        return tuple(kind.strip() for kind in self.kv_transports.split(",") if kind.strip())

    @property
    def kv_cache_max_seqs(self) -> int | None:
        return self.max_num_seqs

    @property
    def kv_cache_in_shm(self) -> bool:
        return "shm" in self.kv_transport_kinds and self.device.split(":")[0] == "cpu"
