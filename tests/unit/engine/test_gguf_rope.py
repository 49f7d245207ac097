"""`llama3_rope_scaling`: the Llama 3 RoPE scaling back from llama.cpp's ``rope_freqs``."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.gguf_rope import llama3_divisors, llama3_rope_scaling

LLAMA_3_1 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}  # fmt: skip
LLAMA_3_2 = {**LLAMA_3_1, "factor": 32.0}


@pytest.mark.parametrize(
    ("scaling", "rope_theta", "rotary_dim"),
    [
        (LLAMA_3_1, 500000.0, 128),  # Llama 3.1 8B/70B
        (LLAMA_3_2, 500000.0, 64),  # Llama 3.2 1B
        ({**LLAMA_3_1, "original_max_position_embeddings": 32}, 10000.0, 16),  # one in between
        ({**LLAMA_3_1, "low_freq_factor": 2.0, "original_max_position_embeddings": 30}, 1e4, 16),
    ],
)
def test_scaling_gives_the_file_divisors_back(
    scaling: dict[str, float], rope_theta: float, rotary_dim: int
) -> None:
    divisors = llama3_divisors(scaling, rope_theta, rotary_dim).astype(np.float32)

    recovered = llama3_rope_scaling(divisors, rope_theta, rotary_dim)

    assert recovered is not None
    assert recovered["rope_type"] == "llama3"
    assert recovered["factor"] == scaling["factor"]
    assert isinstance(recovered["original_max_position_embeddings"], int)
    recomputed = llama3_divisors(recovered, rope_theta, rotary_dim)
    np.testing.assert_allclose(recomputed, divisors, rtol=1e-5)


def test_the_llama_3_1_settings_come_back_as_written() -> None:
    divisors = llama3_divisors(LLAMA_3_1, 500000.0, 128).astype(np.float32)

    assert llama3_rope_scaling(divisors, 500000.0, 128) == {"rope_type": "llama3", **LLAMA_3_1}


def test_all_ones_is_no_scaling() -> None:
    assert llama3_rope_scaling(np.ones(64, np.float32), 500000.0, 128) is None


def test_divisors_of_another_shape_are_refused() -> None:
    divisors = np.linspace(8.0, 1.0, 64, dtype=np.float32)  # decreasing: not Llama 3's
    with pytest.raises(ValueError, match="Llama 3"):
        llama3_rope_scaling(divisors, 500000.0, 128)
