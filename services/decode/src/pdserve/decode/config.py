"""Settings of a decode instance: one frozen dataclass that also defines the CLI flags."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config import port_setting, setting
from pdserve.serving.config import InstanceConfig, transport_list

DEFAULT_PORT = 50070
KV_TRANSPORTS = ("nixl", "cuda_ipc", "shm", "tcp")


@dataclass(frozen=True)
class DecodeConfig(InstanceConfig):
    """Configuration of `pdserve-decode`. Field help texts are the CLI's ``--help``."""

    port: int = port_setting(DEFAULT_PORT, "gRPC port; 0 picks a free port")
    max_num_seqs: int = setting(64, "most requests decoded together in one step", gt=0)
    reserve_tokens: int = setting(
        32,
        "growth headroom (tokens) kept free per running request; new leases are "
        "admitted only from blocks beyond it",
        min=0,
    )
    lease_ttl_ms: int = setting(
        30_000, "a lease not committed and attached within this time is reclaimed", gt=0
    )
    capacity_retry_ms: int = setting(
        200, "retry delay suggested with DECODE_CAPACITY_EXHAUSTED", min=0
    )
    max_lease_share: float = setting(
        0.5,
        "fraction of the KV pool one prefill may hold in leases not yet committed "
        "while other prefills ask for blocks too; more is refused with "
        "DECODE_CAPACITY_EXHAUSTED (the prefill waits and asks again), except a prefill's "
        "only uncommitted lease",
        gt=0,
        max=1,
    )
    share_wait_ms: int = setting(
        500,
        "how long AllocateBlocks for a completion of a prompt (a share key) waits "
        "for the KV of another completion of it that is still on its way, to share its "
        "full prompt blocks instead of receiving them again; 0 never waits (fresh blocks)",
        min=0,
    )
    kv_transports: str = setting(
        "cuda_ipc,shm,nixl,tcp",
        "KV transports offered to prefills besides gRPC SyncCache (always offered), "
        "comma-separated in order of preference: nixl (the KV cache registered with a NIXL "
        "agent, which a prefill writes into with one-sided WRITEs over UCX; offered once the "
        "agent started, where the nixl extra is installed), cuda_ipc (the CUDA KV cache "
        "exported through CUDA IPC, which a prefill on this host writes into device to device; "
        "offered only for a cache on CUDA), shm (the KV cache in a shared-memory segment "
        "that a prefill on this host writes into; needs a CPU KV cache) and tcp (a raw TCP "
        "data port; into a CUDA cache through pinned host buffers); empty offers gRPC only",
    )
    release_window_blocks: bool = setting(
        True,
        "sliding-window layers (Gemma 3, gpt-oss, Mistral) keep only their window: "
        "their KV lives in window slots that a request lets go of once its next token is a "
        "whole window past a block, a lease skips those layers' KV of the prompt blocks a "
        "window behind its end (the prefill does not send it), and the memory goes to "
        "more blocks for the other layers (the slots are sized for --max-num-seqs requests "
        "of a window each: set it to what the memory holds). No effect on a model without "
        "sliding layers, with CUDA graphs or with tensor parallelism on CUDA. cuda_ipc, "
        "which addresses every layer by block id, is then not offered: "
        "--no-release-window-blocks keeps every layer's blocks and that transport",
    )
    kv_tcp_port: int = port_setting(
        0, "port of the TCP KV data port (bound on --host); 0 picks a free port"
    )
    kv_offload_wait_ms: int = setting(
        1000,
        "with --kv-store, how long a preemption notice waits for the offload of "
        "the request's blocks; a notice sent before the write landed carries no key (the "
        "reschedule recomputes those blocks)",
        min=0,
    )
    detached_keep_s: float = setting(
        60.0,
        "how long (seconds) a resumable request is kept without a Generate stream: "
        "one whose gateway went away runs on (detached) and is released unless a resume "
        "attaches within this time; one that ended is kept this long after its end so "
        "that its tokens can be replayed, then forgotten",
        gt=0,
    )
    max_detached_requests: int = setting(
        256,
        "most detached resumable requests kept at once; a resumable stream that "
        "breaks while this many are detached releases its request at once, like a "
        "non-resumable one (each kept request holds its blocks and at most the model's "
        "length in token ids)",
        min=0,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.kv_transport_kinds  # NOTE: a bad list is refused at start, not at first use

    @property
    def kv_transport_kinds(self) -> tuple[str, ...]:
        """The offered transports besides gRPC (always offered), in order of preference."""
        return transport_list(self.kv_transports, KV_TRANSPORTS, at_least_one=False)

    @property
    def kv_cache_max_seqs(self) -> int | None:
        return self.max_num_seqs

    @property
    def runs_decode_steps(self) -> bool:
        return True

    @property
    def kv_cache_in_shm(self) -> bool:
        return "shm" in self.kv_transport_kinds and self.device.split(":")[0] == "cpu"

    @property
    def kv_cache_releases_window_blocks(self) -> bool:
        return self.release_window_blocks
