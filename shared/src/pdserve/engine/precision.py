"""What the weights are stored and computed in: ``--dtype`` (``auto`` resolved here) and the
names of ``--quantization`` (`pdserve.engine.quant`). Importing this module loads no torch.

A GGUF's 4-bit tensors (Q4_0, Q4_1, Q4_K, and its Q8_0, Q6_K and Q5_K ones as int8) are kept
as the file stores them under ``auto`` quantization on a CPU, so ``--dtype auto`` serves the
file's own weights: in bfloat16 on pdserve's AVX512-BF16 kernels (or torch's int4 kernel), in
float32 on pdserve's AVX2 kernels (`pdserve.engine.cpu_kernels`). Where neither runs, float32
dequantizes them exactly (torch's int4 kernel with float32 activations is 16-40x slower than a
float32 GEMM).

``auto`` is bfloat16 weights and KV where the CPU computes bf16 natively, else float32.
Decode on a CPU is bound by streaming the weights from memory each step; bfloat16 halves that
stream, and oneDNN's GEMMs run it on the CPU's bf16 instructions (AVX512-BF16 or AMX). Without
them, bf16 is emulated and no faster than float32, which then keeps its exactness. On other
devices auto is float32 (choose bfloat16 on a GPU explicitly).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

CPUINFO = Path("/proc/cpuinfo")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 CPU flags of bf16 dot products that oneDNN uses (either suffices)."""
AUTO = "auto"
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
"""``auto`` keeps a GGUF's int4 weights as the file stores them where torch's int4 kernel runs
them (bfloat16 on a CPU, one rank), and dequantizes them elsewhere; ``none`` dequantizes every
weight; ``int8`` / ``int4`` quantize the float weights (`pdserve.engine.quant`)."""
REQUANTIZATIONS = ("int8", "int4")
"""The quantizations that quantize float weights: CPU only, one rank."""


@dataclass(frozen=True)
class DtypeChoice:
    """What ``--dtype`` resolved to, and why (the start-up ``dtype_resolved`` event).

    Attributes:
        dtype: The weight (and default KV) dtype name, e.g. ``bfloat16``.
        requested: What was asked for: ``auto`` or a dtype name.
        reason: ``requested`` (an explicit dtype), ``cpu_native_bf16``, ``cpu_without_native_bf16``
            or ``not_a_cpu`` (auto keeps float32 on other devices).
        cpu_bf16_flags: The native bf16 flags the CPU reports (empty off x86 Linux).
    """

    dtype: str
    requested: str
    reason: str
    cpu_bf16_flags: tuple[str, ...] = ()


@functools.cache
def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The flags of the first processor in ``/proc/cpuinfo``; empty where it is unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16_flags(flags: frozenset[str]) -> tuple[str, ...]:
    """Those of `NATIVE_BF16_FLAGS` in `flags`, in that order."""
    return tuple(flag for flag in NATIVE_BF16_FLAGS if flag in flags)


def choose_dtype(
    requested: str, device: torch.device, flags: frozenset[str] | None = None
) -> DtypeChoice:
    """Resolves ``auto`` for `device`; an explicit dtype name is returned as requested.

    Args:
        requested: ``auto`` or a dtype name (validated by the caller).
        device: Where the model runs.
        flags: The CPU flags; those of this machine when None.
    """
    import torch

    if requested != AUTO:
        return DtypeChoice(requested, requested, "requested")
    if device.type != "cpu":
        return DtypeChoice("float32", requested, "not_a_cpu")
    found = native_bf16_flags(cpu_flags() if flags is None else flags)
    # NOTE: torch must also run bf16 through oneDNN, or bf16 GEMMs fall back to slow loops.
    if (
        found
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return DtypeChoice("bfloat16", requested, "cpu_native_bf16", found)
    return DtypeChoice("float32", requested, "cpu_without_native_bf16", found)
