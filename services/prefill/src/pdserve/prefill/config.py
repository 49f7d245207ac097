"""Settings of a prefill instance: one frozen dataclass that also defines the CLI flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.grpc_server import MAX_MESSAGE_BYTES

DEFAULT_PORT = 50060


@dataclass(frozen=True)
class PrefillConfig:
    """Configuration of `pdserve-prefill`. Field help texts are the CLI's ``--help``."""

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
        default=None,
        metadata={
            "help": "KV cache blocks of this prefill (prompts being computed or shipped); "
            "sized by --kv-cache-memory-mb if unset"
        },
    )
    kv_cache_memory_mb: int = field(
        default=256, metadata={"help": "KV cache budget in MiB when --num-blocks is unset"}
    )
    block_size: int = field(
        default=16, metadata={"help": "tokens per KV block (must equal the decodes')"}
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata={
            "help": "token budget of one forward pass: several prompts share a pass, longer "
            "prompts are chunked across passes"
        },
    )
    max_queue_len: int = field(
        default=256,
        metadata={
            "help": "most requests held at once (preparing, queued, computing or shipping); "
            "beyond it Prefill answers PREFILL_OVERLOADED"
        },
    )
    prepare_concurrency: int = field(
        default=8,
        metadata={
            "help": "most AllocateBlocks calls in flight to one decode instance; requests for "
            "other decodes never wait for these slots"
        },
    )
    allocate_timeout_ms: int = field(
        default=5000,
        metadata={
            "help": "how long a request may wait for its decode's lease (slot wait included) "
            "before it fails with PEER_UNAVAILABLE"
        },
    )
    max_chunk_bytes: int = field(
        default=1 << 20,
        metadata={"help": "most K+V bytes per SyncCache chunk (one layer's run of blocks)"},
    )
    dtype: str = field(default="float32", metadata={"help": "weights and KV dtype"})
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda:0"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "longest sequence served; the model's limit when unset"}
    )
    drain_timeout_s: float = field(
        default=30.0, metadata={"help": "on SIGTERM, how long requests in flight may finish"}
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
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_queue_len": self.max_queue_len,
            "prepare_concurrency": self.prepare_concurrency,
            "allocate_timeout_ms": self.allocate_timeout_ms,
            "max_chunk_bytes": self.max_chunk_bytes,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        # NOTE: a chunk also carries its header fields; keep the K+V payload well inside the
        # channels' message limit.
        if self.max_chunk_bytes > MAX_MESSAGE_BYTES // 2:
            raise ValueError(
                f"max_chunk_bytes must be <= {MAX_MESSAGE_BYTES // 2} (half the gRPC message "
                f"limit), got {self.max_chunk_bytes}"
            )
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
