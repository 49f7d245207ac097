"""The runner of one instance, as its configuration asks: a `ModelRunner` in this process, or,
with ``tensor_parallel_size`` above one, rank 0 of a tensor-parallel group
(`pdserve.engine.parallel.runner.TensorParallelRunner`, the same interface) that starts the
other ranks."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig
from pdserve.engine.parallel.runner import TensorParallelRunner
from pdserve.engine.runner import ModelRunner


def load_runner(config: EngineConfig) -> ModelRunner:
    """Loads the model named by ``config`` and allocates its KV cache, on one rank or on
    ``config.tensor_parallel_size`` of them."""
    if config.tensor_parallel_size > 1:
        return TensorParallelRunner.load(config)
    return ModelRunner.load(config)
