"""SmolLM3: Llama without RoPE on the layers ``no_rope_layers`` marks (by default every
``no_rope_layer_interval``-th: every fourth in the released model), and a sliding window only
with ``use_sliding_window``.

GGUF: ``smollm3`` files, q/k rows permuted as Llama's; the file does not say which layers go
without RoPE: every fourth, as llama.cpp hardcodes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import DENSE_LAYER_NAMES, ArchitectureRules
from pdserve.engine.hf_config import opt_in_windows

# NOTE: llama.cpp hardcodes SmolLM3's layers without RoPE: every fourth.
SMOLLM3_NO_ROPE_LAYER_INTERVAL = 4


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    num_layers = fields["num_hidden_layers"]
    # NOTE: no_rope_layers holds 1 where a layer uses RoPE (despite the name).
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        flags = [(i + 1) % interval != 0 for i in range(num_layers)]
    fields["rope_layers"] = tuple(bool(flag) for flag in flags)
    fields["sliding_windows"] = opt_in_windows(hf, num_layers)


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    interval = SMOLLM3_NO_ROPE_LAYER_INTERVAL
    config["no_rope_layer_interval"] = interval
    config["no_rope_layers"] = [
        int((layer + 1) % interval != 0) for layer in range(config["num_hidden_layers"])
    ]


FAMILY = Family(
    "smollm3",
    config=_config,
    gguf=GgufFamily(
        "smollm3",
        ArchitectureRules("smollm3", "SmolLM3ForCausalLM", DENSE_LAYER_NAMES, is_qk_permuted=True),
        config=_gguf_config,
    ),
)
