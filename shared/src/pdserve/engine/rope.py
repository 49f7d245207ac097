"""Rotary position embeddings (default, linear, Llama 3 and YaRN frequency scaling)."""

from __future__ import annotations

import math

import torch

from pdserve.engine.model_config import RopeConfig


def compute_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies exactly as transformers computes them, in float32.

    Args:
        rope: The rotary settings of the model.
        head_dim: Size of one attention head.

    Returns:
        ``[head_dim // 2]`` float32 inverse frequencies.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv_freq)
    if rope.rope_type != "llama3":
        return inv_freq
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / rope.low_freq_factor
    high_freq_wavelen = old_context_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # NOTE: long wavelengths are divided by factor, short ones kept, the band between smoothed.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig, dim: int, extrapolation: torch.Tensor) -> torch.Tensor:
    """YaRN: high frequencies kept, low ones divided by `factor`, a linear ramp between
    (transformers' ``_compute_yarn_parameters``)."""
    interpolation = extrapolation / rope.factor
    context = rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        turns = context / (num_rotations * 2 * math.pi)
        return (dim * math.log(turns)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # NOTE: as transformers, against a division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp
    return interpolation * (1 - kept) + extrapolation * kept


class RotaryEmbedding:
    """Computes cos/sin for a batch of positions once per step and applies them per layer.

    The per-step tables are computed on the fly from the positions (no table of
    ``max_position_embeddings`` rows), in float32 like the reference implementation.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        self.head_dim = head_dim
        # inv_freq: [head_dim // 2]
        self.inv_freq = compute_inv_freq(rope, head_dim).to(device)
        self.attention_factor = rope.attention_factor

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the given token positions.

        Args:
            positions: ``[num_tokens]`` integer positions.
            dtype: The activation dtype to cast the tables to.

        Returns:
            ``(cos, sin)``, each ``[num_tokens, 1, head_dim]``, broadcastable over heads.
        """
        # freqs: [num_tokens, head_dim // 2]
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` (``[num_tokens, num_heads, head_dim]``) by the half-split convention.

    When the tables are narrower than a head (a partial rotary factor), only the leading
    ``cos.shape[-1]`` dims rotate and the rest pass through.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated_part = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated_part, x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
