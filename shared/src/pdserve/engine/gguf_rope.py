"""The Llama 3 RoPE scaling a GGUF file's ``rope_freqs`` tensor stands for.

llama.cpp's converter does not write a Llama 3.1/3.2 model's ``rope_scaling`` (``rope_type:
llama3``) as metadata; it computes one divisor per rotary frequency and stores them as the
``rope_freqs.weight`` tensor: 1 for short wavelengths, ``factor`` for long ones, and between them
``1 / ((1 - s) / factor + s)`` with ``s = (original_max_position_embeddings / wavelength -
low_freq_factor) / (high_freq_factor - low_freq_factor)``. `llama3_rope_scaling` recovers the
four settings from the divisors, so that the directory's config is the one transformers reads,
and checks that they give the stored divisors back.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# NOTE: Llama 3.x's own factors. Between the plateaus s is linear in 1 / wavelength, so the
# divisors fix two numbers, not three: the original context is taken as the whole number that
# puts low_freq_factor nearest Llama 3's 1 (Llama 3.1 and 3.2 come back exactly), and with a
# single divisor between the plateaus the band is assumed as wide as Llama 3's (4 / 1).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
# The divisors are float32: a recovered setting reproduces them to this relative error.
_RTOL = 1e-5


def llama3_divisors(scaling: dict[str, Any], rope_theta: float, rotary_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores for a ``llama3`` `scaling`."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    wavelength = 2 * math.pi / inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    smooth = (original / wavelength - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelength > original / low, factor, medium)
    return np.where(wavelength < original / high, 1.0, divisors)


def llama3_rope_scaling(
    divisors: np.ndarray, rope_theta: float, rotary_dim: int
) -> dict[str, Any] | None:
    """The ``rope_scaling`` config whose divisors are `divisors` (None if all are 1).

    Raises:
        ValueError: If no ``llama3`` scaling gives these divisors.
    """
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if divisors.size != rotary_dim // 2:
        raise ValueError(
            f"rope_freqs holds {divisors.size} values for a rotary dimension of {rotary_dim}"
        )
    if np.allclose(divisors, 1.0, rtol=0, atol=_RTOL):
        return None
    factor = float(divisors.max())
    # x: [rotary_dim / 2] inverse wavelengths, increasing
    x = 1.0 / rope_theta ** (np.arange(0, rotary_dim, 2) / rotary_dim) / (2 * math.pi)
    # NOTE: between the plateaus s = slope * x + offset; s <= 0 is the scaled plateau, s >= 1
    # the unscaled one.
    is_scaled = divisors >= factor * (1 - _RTOL)
    is_medium = ~is_scaled & (divisors > 1 + _RTOL)
    smooth = (1 / divisors[is_medium] - 1 / factor) / (1 - 1 / factor)
    if is_medium.sum() >= 2:
        slope, offset = np.polyfit(x[is_medium], smooth, 1)
    elif is_medium.sum() == 1:
        offset = -LLAMA3_LOW_FREQ_FACTOR / (LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
        slope = (smooth[0] - offset) / x[is_medium][0]
    else:
        # NOTE: no frequency between the plateaus: any band in the gap reproduces the file;
        # this one spans the middle of the gap.
        largest_scaled, smallest_unscaled = x[is_scaled].max(), x[~is_scaled].min()
        start = largest_scaled * (smallest_unscaled / largest_scaled) ** (1 / 3)
        end = largest_scaled * (smallest_unscaled / largest_scaled) ** (2 / 3)
        slope, offset = 1 / (end - start), -start / (end - start)
    if offset >= 0 or slope <= 0:
        raise ValueError("rope_freqs does not follow Llama 3's RoPE scaling")
    original = max(1, round(float(slope) * LLAMA3_LOW_FREQ_FACTOR / -float(offset)))
    span = original / float(slope)
    low = -float(offset) * span
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": round(low, 6),
        "high_freq_factor": round(low + span, 6),
        "original_max_position_embeddings": original,
    }
    if not np.allclose(llama3_divisors(scaling, rope_theta, rotary_dim), divisors, rtol=_RTOL):
        raise ValueError("rope_freqs does not follow Llama 3's RoPE scaling")
    return scaling
