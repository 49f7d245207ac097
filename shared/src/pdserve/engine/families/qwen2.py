"""Qwen2 and Qwen2.5: Llama with a bias on q, k and v (``qkv_bias``, on unless the config turns
it off), and a sliding window only with ``use_sliding_window``, from ``max_window_layers`` on.

GGUF: ``qwen2`` files, Llama's tensors unpermuted; their q/k/v biases are the default ones,
not ``attention_bias``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import DENSE_LAYER_NAMES, ArchitectureRules
from pdserve.engine.hf_config import max_window_layers_windows


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    fields["qkv_bias"] = fields["qkv_bias"] or hf.get("qkv_bias", True) is not False
    fields["sliding_windows"] = max_window_layers_windows(hf, fields["num_hidden_layers"])


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    config["attention_bias"] = False


FAMILY = Family(
    "qwen2",
    config=_config,
    gguf=GgufFamily(
        "qwen2",
        ArchitectureRules("qwen2", "Qwen2ForCausalLM", DENSE_LAYER_NAMES),
        config=_gguf_config,
    ),
)
