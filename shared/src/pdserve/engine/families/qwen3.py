"""Qwen3 (dense): Llama with an RMSNorm over each head of q and k before RoPE, a ``head_dim``
of its own, and a sliding window only with ``use_sliding_window``, from ``max_window_layers``
on.

GGUF: ``qwen3`` files, with the q/k norms.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.families import Family, GgufFamily
from pdserve.engine.gguf_architectures import DENSE_LAYER_NAMES, QK_NORM_NAMES, ArchitectureRules
from pdserve.engine.hf_config import max_window_layers_windows


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    fields["qk_norm"] = True
    fields["sliding_windows"] = max_window_layers_windows(hf, fields["num_hidden_layers"])


FAMILY = Family(
    "qwen3",
    config=_config,
    gguf=GgufFamily(
        "qwen3",
        ArchitectureRules("qwen3", "Qwen3ForCausalLM", DENSE_LAYER_NAMES | QK_NORM_NAMES),
    ),
)
