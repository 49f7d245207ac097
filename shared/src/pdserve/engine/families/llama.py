"""Llama (Llama 2 and 3.x, SmolLM2): the shared rules as they are, and no sliding window,
whatever the config says.

GGUF: ``llama`` files without experts (with them they are Mixtral's); llama.cpp interleaves
the rotary halves of each head's q/k rows, which are put back, and writes Llama 3's RoPE
scaling as the ``rope_freqs`` divisors, read back into ``rope_scaling``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.families import Family, GgufFamily
from pdserve.engine.gguf_architectures import DENSE_LAYER_NAMES, ArchitectureRules


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    fields["sliding_windows"] = ()


FAMILY = Family(
    "llama",
    config=_config,
    gguf=GgufFamily(
        "llama",
        ArchitectureRules("llama", "LlamaForCausalLM", DENSE_LAYER_NAMES, is_qk_permuted=True),
        reads_rope_freqs=True,
    ),
)
