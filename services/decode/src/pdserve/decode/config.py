"""Settings of a decode instance: one frozen dataclass that also defines the CLI flags."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_PORT = 50070


@dataclass(frozen=True)
class DecodeConfig:
    """Configuration of `pdserve-decode`. Field help texts are the CLI's ``--help``."""

    model: str | None = field(
        default=None,
        metadata={"help": "Hugging Face model directory; the built-in demo model when unset"},
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name clients use; the directory name when unset"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address the gRPC server binds"})
    port: int = field(default=DEFAULT_PORT, metadata={"help": "gRPC port; 0 picks a free port"})
    advertise_address: str | None = field(
        default=None,
        metadata={"help": "host:port peers use to reach this instance; host:port when unset"},
    )
    gateway: str | None = field(
        default=None, metadata={"help": "gateway host:port to register with and heartbeat to"}
    )
    instance_id: str | None = field(
        default=None, metadata={"help": "stable instance id; a random one when unset"}
    )
    num_blocks: int | None = field(
        default=None, metadata={"help": "KV cache blocks; sized by --kv-cache-memory-mb if unset"}
    )
    kv_cache_memory_mb: int = field(
        default=256, metadata={"help": "KV cache budget in MiB when --num-blocks is unset"}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
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
    dtype: str = field(default="float32", metadata={"help": "weights and KV dtype"})
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda:0"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest sequence served; the model's limit when unset"}
    )
    drain_timeout_s: float = field(
        default=30.0, metadata={"help": "on SIGTERM, how long running requests may finish"}
    )
    metrics_port: int | None = field(
        default=None,
        metadata={
            "help": "port of the Prometheus /metrics endpoint; 0 picks a free one; off if unset"
        },
    )
    otlp_endpoint: str | None = field(
        default=None,
        metadata={
            "help": "OTLP/gRPC collector for traces, e.g. localhost:4317 (Jaeger); the standard "
            "OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_TRACES_EXPORTER variables also work; off if unset"
        },
    )
    trace_sample_ratio: float | None = field(
        default=None,
        metadata={"help": "fraction of new traces kept (parent-based); all when unset"},
    )
    log_level: str = field(
        default="info",
        metadata={"help": "log level", "choices": ("debug", "info", "warning", "error")},
    )

    def __post_init__(self) -> None:
        if self.trace_sample_ratio is not None and not 0.0 <= self.trace_sample_ratio <= 1.0:
            raise ValueError(f"trace_sample_ratio must be in [0, 1], got {self.trace_sample_ratio}")
        positive = {
            "kv_cache_memory_mb": self.kv_cache_memory_mb,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "lease_ttl_ms": self.lease_ttl_ms,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {self.reserve_tokens}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.capacity_retry_ms < 0 or self.drain_timeout_s < 0:
            raise ValueError("capacity_retry_ms and drain_timeout_s must be >= 0")
