"""Settings shared by the prefill and decode services (model, cache, server, lifecycle)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.common.config import ServiceConfig, port_setting, setting
from pdserve.common.etcd_registry import REGISTRY_HELP, check_registry_spec
from pdserve.engine.model_store import DEFAULT_MODEL, MODEL_HELP
from pdserve.engine.precision import AUTO, QUANTIZATIONS

DEFAULT_KV_STORE_QUEUE_LEN = 64
DETERMINISTIC_DEFAULT = False


@dataclass(frozen=True)
class InstanceConfig(ServiceConfig):
    """What every prefill and decode instance is configured with; field help is ``--help``."""

    model: str = setting(DEFAULT_MODEL, MODEL_HELP)
    served_model_name: str | None = setting(
        None, "model name clients use; the known name, file stem or directory name"
    )
    host: str = setting("127.0.0.1", "address the gRPC server binds")
    port: int = port_setting(0, "gRPC port; 0 picks a free port")
    advertise_address: str | None = setting(
        None, "host:port peers use to reach this instance; host:port when unset"
    )
    gateway: str | None = setting(
        None,
        "gateway internal host:port to register with and heartbeat to (the "
        "embedded registry; see --registry for several gateways)",
    )
    registry: str | None = setting(None, REGISTRY_HELP)
    registry_ttl_s: float = setting(
        10.0,
        "with --registry etcd://...: TTL of the etcd lease that keeps this "
        "instance registered (whole seconds); a lapsed lease removes it from every gateway",
    )
    heartbeat_interval_s: float = setting(
        2.0,
        "with --registry etcd://...: seconds between lease keep-alives, each with a "
        "fresh load report",
        gt=0,
    )
    instance_id: str | None = setting(None, "stable instance id; a random one when unset")
    num_blocks: int | None = setting(
        None,
        "KV cache blocks; when unset, what --kv-cache-memory-mb holds, or sized from "
        "free memory without it",
        gt=0,
    )
    kv_cache_memory_mb: int | None = setting(
        None,
        "KV cache budget in MiB when --num-blocks is unset; when both are unset the "
        "cache is sized from free memory (see --kv-cache-memory-fraction)",
        gt=0,
    )
    kv_cache_memory_fraction: float | None = setting(
        None,
        "with neither --num-blocks nor --kv-cache-memory-mb, the share of free "
        "memory the KV cache takes at start: on CPU of available RAM (MemAvailable, or the "
        "cgroup's limit less its usage when less), default 0.1, at most 4 GiB, and for a "
        "decode offering shm at most half of /dev/shm's free space; on a GPU of its free "
        "memory once the weights are loaded, default 0.9, less 512 MiB for activations. "
        "Never more than room for one --max-model-len sequence per request held at once "
        "(a decode's --max-num-seqs, a prefill's --max-queue-len) plus one; at least one "
        "such sequence when it fits in half the available memory",
        gt=0,
        max=1,
    )
    block_size: int = setting(16, "tokens per KV block (prefills and decodes must agree)", gt=0)
    dtype: str = setting(
        AUTO,
        "weights and KV dtype: auto (bfloat16 on a CPU with native bf16, i.e. "
        "AVX512-BF16 or AMX, else float32; the dtype_resolved log line says which), float32, "
        "bfloat16 or float16. Prefills and decodes must agree: pin it where their machines "
        "differ",
    )
    quantization: str = setting(
        AUTO,
        "weight-only quantization on CPU: auto keeps a GGUF's Q4_0/Q4_1/Q4_K "
        "weights as the file stores them (int4 groups of 32) where the weights are bfloat16 "
        "on a CPU with one rank, else dequantizes them (the model_loaded log line says what "
        "each tensor type became); none dequantizes every weight to --dtype; int8 (per "
        "output channel) or int4 (groups of 32) quantize every projection but the LM head "
        "from the float weights. Activations and KV keep --dtype",
        choices=QUANTIZATIONS,
    )
    device: str = setting("cpu", "torch device, e.g. cpu or cuda:0")
    enforce_eager: bool = setting(
        False,
        "never replay decode steps from CUDA graphs (a decode on CUDA captures one "
        "per batch-size bucket up to --max-num-seqs at start; a prefill runs no decode "
        "steps and captures none; on CPU every step is eager)",
    )
    deterministic: bool = setting(
        DETERMINISTIC_DEFAULT,
        "batch-invariant numerics: a request's tokens and logprobs do not depend on "
        "the other requests of a step, on prompt chunking or the prefix cache, and a "
        "prefill and a decode that both set it compute the same K/V for a token, so a "
        "stream that is recomputed after a move or preemption continues with the same "
        "tokens (in bfloat16 too). Costs throughput (the default model at 16 clients on a "
        "CPU with AMX: 0.95x tokens/s; a lone stream's token about 4x as long; "
        "docs/BENCHMARKS.md); runs SDPA "
        "in its invariant form and no flash-attn or decode graphs. Set it on prefills and "
        "decodes alike; the batch_invariant log line says it is on",
    )
    num_threads: int | None = setting(
        None,
        "torch intra-op threads; torch's default (all cores) when unset. Give each "
        "process its share when several run on one machine (pdserve up does)",
        gt=0,
    )
    kernel_threads: int = setting(
        1,
        "threads that share each GEMM of a one-row decode step (one user) on the "
        "int4/int8 kernels (float32 or bf16): a lone user's step waits on reading the "
        "weights, and one thread keeps too few reads in flight on the float32 kernels (about "
        "1.5x faster with 2; the bf16 ones read near the memory's speed alone, "
        "docs/BENCHMARKS.md); the same tokens whatever the count. "
        "Steps of more rows keep one thread, leaving the other cores to the other engines "
        "(pdserve up gives a decode every core on the float32 kernels, one thread on the bf16 "
        "ones)",
        gt=0,
    )
    max_model_len: int | None = setting(
        None, "longest sequence served; the model's limit when unset", gt=1
    )
    tensor_parallel_size: int = setting(
        1,
        "ranks (processes) the model is split over; this process serves as rank 0 "
        "and starts the others. CPU only; the heads must split (or replicate) evenly",
        gt=0,
    )
    tensor_parallel_timeout_s: float = setting(
        120.0, "how long the ranks may take to form their group and load at start-up", gt=0
    )
    tensor_parallel_step_timeout_s: float = setting(
        30.0,
        "the longest a rank waits on the others within a step: a rank silent for "
        "longer (frozen, wedged) is taken as lost and the instance goes down, to be started "
        "again",
        gt=0,
    )
    drain_timeout_s: float = setting(30.0, "on SIGTERM, how long work in flight may finish", min=0)
    metrics_port: int | None = port_setting(
        None, "port of the Prometheus /metrics endpoint; 0 picks a free one; off if unset"
    )
    health_port: int | None = port_setting(
        None,
        "port of a plaintext gRPC server that answers grpc.health.v1 only (for "
        "probes that cannot present a client certificate, such as Kubernetes'); 0 picks a "
        "free one; off if unset",
    )
    kv_store: str | None = setting(
        None,
        "KV storage tier shared by instances: file:DIR[?max_bytes=N] (one host) or "
        "redis://HOST:PORT[/DB] (shared). The decode offloads preempted requests' blocks "
        "there, the prefill writes computed prompt blocks and loads stored prefixes "
        "instead of computing them; off if unset",
    )
    kv_store_queue_len: int = setting(
        DEFAULT_KV_STORE_QUEUE_LEN,
        "most KV store writes waiting at once; beyond it the oldest is dropped",
        gt=0,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_store is not None:
            # NOTE: imported here so that --help and other refused flags never load torch.
            from pdserve.kv.stores import check_store_spec

            try:
                check_store_spec(self.kv_store)
            except ValueError as error:
                raise ValueError(f"kv_store: {error}") from None
        try:
            check_registry_spec(self.registry)
        except ValueError as error:
            raise ValueError(f"--registry: {error}") from None
        if self.registry is not None and self.gateway is not None:
            raise ValueError("--gateway and --registry exclude each other: register in one place")
        if not 0 < self.heartbeat_interval_s < self.registry_ttl_s:
            raise ValueError(
                "heartbeat_interval_s must be > 0 and below registry_ttl_s "
                f"({self.heartbeat_interval_s}, {self.registry_ttl_s})"
            )

    @property
    def kv_cache_max_seqs(self) -> int | None:
        """Most requests holding KV blocks at once (bounds an automatic cache size); None when
        the role sets no such limit."""
        return None

    @property
    def kv_cache_in_shm(self) -> bool:
        """Whether the KV cache will be placed in a /dev/shm segment (a decode offering shm)."""
        return False

    @property
    def kv_cache_releases_window_blocks(self) -> bool:
        """Whether the cache's sliding-window layers keep only their window (a decode's
        ``--release-window-blocks``; `pdserve.engine.window_slots`)."""
        return False

    @property
    def runs_decode_steps(self) -> bool:
        """Whether the role's engine steps decodes (a decode), so graphs may pay off."""
        return False


def transport_list(text: str, known: Sequence[str], *, at_least_one: bool) -> tuple[str, ...]:
    """The KV transports a comma-separated ``--kv-transports`` names, in order of preference.

    Raises:
        ValueError: Where it names one not in `known` or one twice, or none where
            `at_least_one`.
    """
    kinds = tuple(kind.strip() for kind in text.split(",") if kind.strip())
    problems = [f"unknown {kind!r}" for kind in dict.fromkeys(kinds) if kind not in known]
    problems += [f"{kind!r} twice" for kind in dict.fromkeys(kinds) if kinds.count(kind) > 1]
    if at_least_one and not kinds:
        problems.append("none named")
    if problems:
        raise ValueError(
            f"kv_transports {text!r}: {', '.join(problems)} (name some of "
            f"{', '.join(known)}, each once)"
        )
    return kinds
