"""Loads a model for serving: the runner, its KV layout and identity, and its tokenizer files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.model_identity import model_id as compute_model_id
from pdserve.engine.batch_invariant import INVARIANT_BACKEND
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.constraints import ConstraintCompiler
from pdserve.engine.load_runner import load_runner
from pdserve.engine.model_store import resolve_model
from pdserve.engine.runner import ModelRunner
from pdserve.kv.transports.shm import SHM_DIR
from pdserve.serving.config import InstanceConfig
from pdserve.serving.convert import kv_layout_to_proto
from pdserve.v1 import common_pb2


@dataclass
class ModelHost:
    """A loaded model with everything a server publishes about it.

    Attributes:
        model_dir: Where the checkpoint lives.
        served_model_name: Name clients use.
        runner: Forward passes on the paged KV cache.
        kv_layout: The KvLayout message (with fingerprint) peers must match.
        max_model_len: Longest sequence served.
        eos_token_ids: Ids that end a completion unless ignore_eos.
    """

    model_dir: Path
    served_model_name: str
    runner: ModelRunner
    kv_layout: common_pb2.KvLayout
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(
        cls,
        model: str | None,
        served_model_name: str | None,
        *,
        num_blocks: int | None,
        kv_cache_memory_mb: int | None,
        block_size: int,
        dtype: str,
        device: str,
        max_model_len: int | None,
        num_threads: int | None = None,
        kernel_threads: int = 1,
        kv_cache_memory_fraction: float | None = None,
        max_seqs: int | None = None,
        kv_cache_in_shm: bool = False,
        tensor_parallel_size: int = 1,
        tensor_parallel_timeout_s: float = 120.0,
        tensor_parallel_step_timeout_s: float = 30.0,
        quantization: str = "auto",
        enforce_eager: bool = False,
        deterministic: bool = False,
        release_window_blocks: bool = False,
        max_step_tokens: int | None = None,
    ) -> ModelHost:
        """Loads the checkpoint and allocates the KV cache.

        Args:
            model: What ``--model`` names (see `resolve_model`); the default model when None.
            served_model_name: The name clients use; the model's own name when None.
            num_blocks: KV blocks; when None, what `kv_cache_memory_mb` holds, or sized from
                free memory when that is None too (`pdserve.engine.kv_budget`).
            kv_cache_memory_fraction: Share of free memory an automatic size takes; the
                device's default when None.
            max_seqs: Most requests holding blocks at once (bounds an automatic size).
            kernel_threads: Threads that share the GEMMs of a one-row decode step
                (`EngineConfig.kernel_threads`).
            kv_cache_in_shm: The cache will be placed in a /dev/shm segment (an automatic size
                then also fits in half its free space).
            tensor_parallel_size: Ranks the model is split over (`pdserve.engine.parallel`);
                CPU only: on CPU rank 0's cache holds every head, so KV moves as without it.
            tensor_parallel_timeout_s: How long the ranks may take to form their group.
            tensor_parallel_step_timeout_s: The longest a rank waits on the others in a step.
            quantization: ``auto``, ``none``, ``int8`` or ``int4`` (`pdserve.engine.config`).
            enforce_eager: Capture no decode graphs on CUDA (`pdserve.engine.graphs`).
            deterministic: Batch-invariant numerics (`pdserve.engine.batch_invariant`).
            release_window_blocks: Sliding-window layers keep only their window
                (`pdserve.engine.window_slots`; one rank, no decode graphs).
            max_step_tokens: Most tokens one step computes (a decode: one per request), which
                sizes the window slots; the engine's default when None.

        Raises:
            ValueError: For a model that names nothing servable, or bad settings.
        """
        if tensor_parallel_size > 1 and not device.startswith("cpu"):
            # NOTE: on CUDA each rank's cache holds only its heads; exporting and importing
            # whole blocks would need a gather and a scatter that are not implemented.
            raise ValueError("tensor_parallel_size above 1 is served on CPU only")
        resolved = resolve_model(model)
        model_dir = resolved.path
        cache = CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            memory_bytes=None if kv_cache_memory_mb is None else kv_cache_memory_mb << 20,
            memory_fraction=kv_cache_memory_fraction,
            max_seqs=max_seqs,
            shm_dir=str(SHM_DIR) if kv_cache_in_shm else None,
            release_window_blocks=release_window_blocks,
        )
        engine_config = EngineConfig(
            model=str(model_dir),
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            num_threads=num_threads,
            kernel_threads=kernel_threads,
            tensor_parallel_size=tensor_parallel_size,
            tensor_parallel_timeout_s=tensor_parallel_timeout_s,
            tensor_parallel_step_timeout_s=tensor_parallel_step_timeout_s,
            quantization=quantization,
            enforce_eager=enforce_eager,
            deterministic=deterministic,
            cache=cache,
            scheduler=SchedulerConfig(
                max_num_seqs=max_seqs or SchedulerConfig.max_num_seqs,
                max_num_batched_tokens=max_step_tokens or SchedulerConfig.max_num_batched_tokens,
            ),
        )
        runner = load_runner(engine_config)
        name = served_model_name or resolved.name
        limit = runner.model_config.max_position_embeddings
        return cls(
            model_dir=model_dir,
            served_model_name=name,
            runner=runner,
            kv_layout=kv_layout_to_proto(runner.kv_cache.layout, compute_model_id(name, model_dir)),
            max_model_len=min(max_model_len or limit, limit),
            eos_token_ids=tuple(runner.model_config.eos_token_ids),
        )

    @classmethod
    def from_config(cls, config: InstanceConfig) -> ModelHost:
        """Loads the configured checkpoint (the demo model when none) and allocates the KV
        cache."""
        return cls.load(
            config.model,
            config.served_model_name,
            num_blocks=config.num_blocks,
            kv_cache_memory_mb=config.kv_cache_memory_mb,
            block_size=config.block_size,
            dtype=config.dtype,
            device=config.device,
            max_model_len=config.max_model_len,
            num_threads=config.num_threads,
            kernel_threads=config.kernel_threads,
            kv_cache_memory_fraction=config.kv_cache_memory_fraction,
            max_seqs=config.kv_cache_max_seqs,
            kv_cache_in_shm=config.kv_cache_in_shm,
            tensor_parallel_size=config.tensor_parallel_size,
            tensor_parallel_timeout_s=config.tensor_parallel_timeout_s,
            tensor_parallel_step_timeout_s=config.tensor_parallel_step_timeout_s,
            quantization=config.quantization,
            enforce_eager=config.enforce_eager or not config.runs_decode_steps,
            deterministic=config.deterministic,
            release_window_blocks=config.kv_cache_releases_window_blocks,
            max_step_tokens=config.kv_cache_max_seqs if config.runs_decode_steps else None,
        )

    @property
    def num_blocks(self) -> int:
        return self.runner.kv_cache.num_blocks

    @property
    def is_batch_invariant(self) -> bool:
        """Whether the engine runs batch-invariant numerics (``--deterministic``)."""
        return self.runner.attention_backend == INVARIANT_BACKEND

    def constraint_compiler(self) -> ConstraintCompiler | None:
        """A compiler of constraints for this model's tokenizer; None without tokenizer.json
        (the instance then refuses constrained requests)."""
        tokenizer_json = _read_text(self.model_dir / "tokenizer.json")
        if not tokenizer_json:
            return None
        return ConstraintCompiler(tokenizer_json, self.eos_token_ids)

    def tokenizer_files(self) -> tuple[str, str, str]:
        """(tokenizer.json text, tokenizer_config.json text, chat template), '' where absent."""
        tokenizer_json = _read_text(self.model_dir / "tokenizer.json")
        config_text = _read_text(self.model_dir / "tokenizer_config.json")
        template = _read_text(self.model_dir / "chat_template.jinja")
        if not template and config_text:
            value = json.loads(config_text).get("chat_template", "")
            template = value if isinstance(value, str) else ""
        return tokenizer_json, config_text, template


def _read_text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""
