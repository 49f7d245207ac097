"""pdserve's compiled CPU kernels (``shared/csrc/``, the optional extension
``pdserve.engine._cpu_kernels``): whether they are here and run on this CPU.

Two sets, by the activations' dtype:

* bfloat16, on a CPU with AVX512-BF16: the int4 and int8 GEMMs (`pdserve.engine.int4_kernel`,
  `pdserve.engine.int8_kernel`), the decode attention (`pdserve.engine.cpu_attention`) and the
  RMSNorm (`pdserve.engine.cpu_norm`);
* float32, on a CPU with AVX2, FMA and F16C (``f32_gemm.cpp`` and the float32 forms in
  ``decode_attention.cpp`` and ``rms_norm.cpp``): the int4 and int8 GEMMs over the same weights,
  the decode attention and the RMSNorm. ``--dtype auto`` is float32 on a CPU without native
  bf16, so a GGUF's quantized tensors are kept as the file stores them there too.

Without a C++ compiler at install time pdserve installs without them, and torch's ops run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

try:
    import pdserve.engine._cpu_kernels as _compiled
except ImportError:  # pragma: no cover - the compiled module is optional
    _compiled = None

MISSING = "the compiled module is not installed (no C++ compiler when pdserve was installed)"
UNSUPPORTED = "this CPU has no AVX512-BF16"
UNSUPPORTED_F32 = "this CPU has no AVX2, FMA or F16C"


def compiled() -> ModuleType:
    """The compiled module (call only where `available`)."""
    assert _compiled is not None
    return _compiled


def kernel(name: str, dtype: torch.dtype) -> Callable[..., None]:
    """The compiled kernel `name` for `dtype` activations: its float32 form (``name_f32``) for
    float32, else the bf16 one (call only where that set is available)."""
    return getattr(compiled(), f"{name}_f32" if dtype == torch.float32 else name)


@functools.cache
def available() -> bool:
    """Whether the compiled module is installed and this CPU runs it."""
    return _compiled is not None and bool(_compiled.supported())


@functools.cache
def f32_available() -> bool:
    """Whether the compiled module is installed and this CPU runs its float32 GEMMs."""
    return _compiled is not None and bool(_compiled.f32_supported())


TEAM_MAX_ROWS = 1
"""The most input rows of a GEMM the kernel team shares by default: a one-row decode step (one
user), the step that waits on memory; a step of more rows keeps the other cores for the other
engines on the machine (a prefill under load)."""


def set_team_threads(threads: int, max_rows: int = TEAM_MAX_ROWS) -> None:
    """How many threads (the caller's included) share the output rows of each int4 or int8 GEMM
    (float32 or bf16 activations) of at most `max_rows` input rows (``shared/csrc/team.cpp``);
    1 runs every call on its caller's thread alone.

    A one-row decode step reads every weight once, and one thread keeps too few reads in flight
    to stream them at the memory's speed: two read them about 1.5x as fast where the second core
    is free on an AVX2 host (float32); on an AVX512-BF16 host one thread already reads near the
    memory's speed and a bf16 step gains about 6% (docs/BENCHMARKS.md). Each output is computed
    as one thread computes it, so the numbers do not change. The threads claim parts of a call
    as they get to run; the caller takes what they leave, so a team thread that another process
    keeps off its core does not hold the step up. A no-op where the compiled kernels do not run
    (nothing to share); the float32 set runs wherever the bf16 one does.
    """
    if threads < 1 or max_rows < 1:
        raise ValueError(f"threads and max_rows must be at least 1, got {threads}, {max_rows}")
    if f32_available():
        compiled().set_team_threads(threads, max_rows)


def team_threads() -> int:
    """The threads of the kernel team (`set_team_threads`); 1 without the compiled kernels."""
    return int(compiled().team_threads()[0]) if f32_available() else 1


def team_shared_parts() -> int:
    """The parts of GEMMs the kernel team's threads (not their callers) computed since the
    process began; 0 without the compiled kernels."""
    return int(compiled().team_threads()[2]) if f32_available() else 0


def why_unavailable(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the kernels for `dtype` activations do not run here (None where they do), for the
    logs."""
    if _compiled is None:
        return MISSING
    if dtype == torch.float32:
        return None if f32_available() else UNSUPPORTED_F32
    return None if available() else UNSUPPORTED


def why_not_gemm(dtype: torch.dtype, in_features: int, multiple: int) -> str | None:
    """Why a GEMM kernel that walks `multiple` input features at a time does not take a
    projection of `in_features` with `dtype` activations (None where it does), for the logs."""
    if dtype not in (torch.bfloat16, torch.float32):
        return f"activations are {str(dtype).removeprefix('torch.')}, not bfloat16 or float32"
    unavailable = why_unavailable(dtype)
    if unavailable is not None:
        return unavailable
    if in_features % multiple:
        return f"in_features {in_features} is not a multiple of {multiple}"
    if torch.get_num_threads() != 1:
        return f"torch runs {torch.get_num_threads()} threads (the kernel runs one)"
    return None


@dataclass(frozen=True)
class GemmFit:
    """What a GEMM kernel that walks `multiple` input features at a time takes (an int4 or
    int8 kernel module's `takes` and `why_not`)."""

    multiple: int

    def takes(self, in_features: int, dtype: torch.dtype) -> bool:
        """Whether the kernel takes a projection of `in_features` with `dtype` activations, on
        one torch thread."""
        return self.why_not(dtype, in_features) is None

    def why_not(self, dtype: torch.dtype, in_features: int | None = None) -> str | None:
        """Why the kernel does not take a projection (None where it does), for the logs;
        without `in_features`, whether it takes `dtype` at all."""
        width = self.multiple if in_features is None else in_features
        return why_not_gemm(dtype, width, self.multiple)
