"""pdserve's compiled CPU kernels (``shared/csrc/``, the optional extension
``pdserve.engine._cpu_kernels``): whether they are here and run on this CPU.

The int4 and int8 GEMMs (`pdserve.engine.int4_kernel`, `pdserve.engine.int8_kernel`), the decode
attention (`pdserve.engine.cpu_attention`) and the RMSNorm (`pdserve.engine.cpu_norm`) need
AVX512-BF16;
without a C++ compiler at install time pdserve installs without them, and torch's ops run.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

try:
    import pdserve.engine._cpu_kernels as _compiled
except ImportError:  # pragma: no cover - the compiled module is optional
    _compiled = None

MISSING = "the compiled module is not installed (no C++ compiler when pdserve was installed)"
UNSUPPORTED = "this CPU has no AVX512-BF16"


def compiled() -> ModuleType:
    """The compiled module (call only where `available`)."""
    assert _compiled is not None
    return _compiled


@functools.cache
def available() -> bool:
    """Whether the compiled module is installed and this CPU runs it."""
    return _compiled is not None and bool(_compiled.supported())


def why_unavailable() -> str | None:
    """Why the kernels do not run here (None where they do), for the logs."""
    if _compiled is None:
        return MISSING
    return None if available() else UNSUPPORTED


def why_not_gemm(dtype: torch.dtype, in_features: int, multiple: int) -> str | None:
    """Why a GEMM kernel that walks `multiple` input features at a time does not take a
    projection of `in_features` with `dtype` activations (None where it does), for the logs."""
    unavailable = why_unavailable()
    if unavailable is not None:
        return unavailable
    if dtype != torch.bfloat16:
        return f"activations are {str(dtype).removeprefix('torch.')}, not bfloat16"
    if in_features % multiple:
        return f"in_features {in_features} is not a multiple of {multiple}"
    if torch.get_num_threads() != 1:
        return f"torch runs {torch.get_num_threads()} threads (the kernel runs one)"
    return None
