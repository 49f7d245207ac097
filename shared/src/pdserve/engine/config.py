"""Engine, cache and scheduler settings: frozen dataclasses validated on construction (their
ranges in field metadata, checked by `pdserve.common.config.check_ranges`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.common.config import check_ranges, setting
from pdserve.engine.precision import (
    AUTO,
    QUANTIZATIONS,
    REQUANTIZATIONS,
    DtypeChoice,
    choose_dtype,
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
ATTENTION_BACKENDS = ("auto", "sdpa", "flash")
LINEAR_BACKENDS = ("auto", "onednn", "torch")


def resolve_dtype(name: str) -> torch.dtype:
    """Maps ``float32`` / ``bfloat16`` / ``float16`` (or ``fp32``, ``bf16``, ``fp16``) to torch."""
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(name, name)
    if key not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[key]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings.

    Attributes:
        block_size: Tokens per KV block.
        num_blocks: Number of blocks; when ``None`` the cache is sized by ``memory_bytes``.
        memory_bytes: KV cache budget in bytes (all layers, K and V) when ``num_blocks`` is
            unset; when both are ``None`` the cache is sized from free memory
            (`pdserve.engine.kv_budget`).
        memory_fraction: Share of the free memory an automatic size takes; ``None`` uses the
            device's default (0.1 of available RAM on CPU, 0.9 of free GPU memory).
        max_seqs: Most sequences holding blocks at once, which bounds an automatic size;
            ``None`` uses the scheduler's ``max_num_seqs``.
        shm_dir: A shared-memory file system the cache will be placed in (a decode's KV
            segment): an automatic size on CPU also takes at most half of its free space.
        dtype: Cache dtype name; ``None`` uses the model dtype.
        enable_prefix_caching: Reuse full blocks whose chained token hash is already cached.
        release_window_blocks: Sliding-window layers keep only their window: their K/V live in
            window slots, let go once every sequence has moved past a block by a window
            (`pdserve.engine.window_slots`; the colocated engine, one rank, no decode graphs).
            The same memory then holds more tokens of the full-attention layers.
    """

    block_size: int = setting(16, gt=0)
    num_blocks: int | None = setting(None, gt=0)
    memory_bytes: int | None = setting(None, gt=0)
    memory_fraction: float | None = setting(None, gt=0, max=1)
    max_seqs: int | None = setting(None, gt=0)
    shm_dir: str | None = None
    dtype: str | None = None
    enable_prefix_caching: bool = False
    release_window_blocks: bool = False

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.dtype is not None:
            resolve_dtype(self.dtype)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_seqs: Most requests in one step.
        max_num_batched_tokens: Token budget of one step (prefill chunks plus decodes).
        enable_chunked_prefill: Split prompts longer than the remaining budget across steps.
    """

    max_num_seqs: int = setting(64, gt=0)
    max_num_batched_tokens: int = setting(2048, gt=0)
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        check_ranges(self)


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an engine.

    Attributes:
        model: Hugging Face model directory (``config.json`` and ``*.safetensors``).
        dtype: Weight and activation dtype: ``auto`` (bfloat16 on a CPU with native bf16, else
            float32; see `pdserve.engine.precision`), ``float32``, ``bfloat16``, ``float16``.
        device: Torch device string, e.g. ``cpu`` or ``cuda:0``.
        max_model_len: Longest sequence (prompt + output); ``None`` uses the model's limit.
        attention_backend: ``auto`` (flash-attn when usable, else SDPA), ``sdpa`` or ``flash``.
        linear_backend: ``auto`` (oneDNN-packed projections for float32 and bfloat16 on CPU,
            else torch's GEMM), ``onednn`` or ``torch``.
        quantization: Weight-only quantization of the projections on CPU: ``auto`` (a GGUF's
            Q4_0 / Q4_1 / Q4_K weights kept as the file stores them where the weights are
            bfloat16 on a CPU with one rank, else dequantized; `pdserve.engine.gguf_int4`; an
            MXFP4 checkpoint's experts, gpt-oss as released, as their own codes where
            pdserve's kernels run,
            `pdserve.engine.moe.KeptExperts`),
            ``none`` (every weight in `dtype`), ``int8`` (per output channel) or ``int4``
            (groups of 32) quantized from the float weights; see `pdserve.engine.quant`.
        seed: Seeds the draw of per-request seeds for requests that carry none.
        num_threads: Torch intra-op threads for this process (a process-wide setting); ``None``
            keeps torch's default. Use 1 when several engines share a few cores: threads of
            one op that wait on a busy core make small kernels orders of magnitude slower.
            Each tensor-parallel rank takes as many.
        kernel_threads: Threads (this one included) that share the output rows of each
            int4/int8 GEMM (float32 or bf16) of a one-row decode step (`pdserve.engine.cpu_kernels`
            `set_team_threads`): a lone user's step waits on reading its weights, and one
            thread keeps too few reads in flight. The same numbers whatever the count. A
            process-wide setting.
        tensor_parallel_size: Ranks (processes) the model is split over: this process is rank
            0 and starts the others (`pdserve.engine.parallel`). On CUDA rank r runs on the
            device index of ``device`` plus r.
        tensor_parallel_timeout_s: How long the ranks may take to form their group and load
            their shares at start-up.
        tensor_parallel_step_timeout_s: Once loaded, the longest a rank waits on the others in
            one collective of a step: a rank silent for longer (frozen, wedged) is taken as
            lost, every rank is stopped and the instance goes down, as when a rank dies.
        enforce_eager: Never capture decode graphs (`pdserve.engine.graphs`). Without it a
            single-rank engine on CUDA captures them after loading; on CPU every step is eager.
        deterministic: Batch-invariant numerics (`pdserve.engine.batch_invariant`): a token's
            logits do not depend on the other rows of its step, on chunking or the prefix
            cache, nor on whether a prefill or a decode computed its K/V. Runs SDPA in its
            invariant form (not flash-attn) and no decode graphs.
    """

    model: str
    dtype: str = AUTO
    device: str = "cpu"
    max_model_len: int | None = setting(None, gt=0)
    attention_backend: str = setting("auto", choices=ATTENTION_BACKENDS)
    linear_backend: str = setting("auto", choices=LINEAR_BACKENDS)
    quantization: str = setting(AUTO, choices=QUANTIZATIONS)
    seed: int | None = None
    num_threads: int | None = setting(None, gt=0)
    kernel_threads: int = setting(1, gt=0)
    tensor_parallel_size: int = setting(1, gt=0)
    tensor_parallel_timeout_s: float = setting(120.0, gt=0)
    tensor_parallel_step_timeout_s: float = setting(30.0, gt=0)
    enforce_eager: bool = False
    deterministic: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model (a Hugging Face model directory) is required")
        if self.dtype != AUTO:
            resolve_dtype(self.dtype)
        check_ranges(self)
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"invalid device {self.device!r}: {exc}") from None
        if self.quantization in REQUANTIZATIONS and device.type != "cpu":
            raise ValueError(
                f"quantization={self.quantization} runs on CPU only (torch's CPU kernels), "
                f"not on {self.device}"
            )
        if self.quantization in REQUANTIZATIONS and self.tensor_parallel_size > 1:
            # NOTE: a quantized projection has no row-parallel form (its all-reduce) yet;
            # under auto the ranks dequantize a GGUF's int4 weights instead.
            raise ValueError(
                f"quantization={self.quantization} does not combine with "
                f"tensor_parallel_size={self.tensor_parallel_size} yet"
            )

    @property
    def uses_graphs(self) -> bool:
        """Whether loading captures decode graphs: CUDA, one rank, not `enforce_eager`."""
        is_cuda = torch.device(self.device).type == "cuda"
        return (
            is_cuda
            and self.tensor_parallel_size == 1
            and not self.enforce_eager
            and not self.deterministic
        )

    @property
    def dtype_choice(self) -> DtypeChoice:
        """What `dtype` resolves to on `device`, and why."""
        return choose_dtype(self.dtype, torch.device(self.device))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The weight dtype as a ``torch.dtype`` (``auto`` resolved)."""
        return resolve_dtype(self.dtype_choice.dtype)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache dtype as a ``torch.dtype``: the cache's own, else the weights'."""
        return resolve_dtype(self.cache.dtype) if self.cache.dtype else self.torch_dtype
