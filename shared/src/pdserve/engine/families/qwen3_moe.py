"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norm) and experts on
every ``decoder_sparse_step``-th layer but ``mlp_only_layers``, renormalised unless
``norm_topk_prob`` is off; with ``use_sliding_window``, a window on every layer.

GGUF: ``qwen3moe`` files, the experts stacked; llama.cpp renormalises the top-k weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import (
    ATTENTION_NAMES,
    QK_NORM_NAMES,
    ROUTED_EXPERT_NAMES,
    ArchitectureRules,
)
from pdserve.engine.gguf_config import qwen_moe_routing
from pdserve.engine.hf_config import qwen_moe, uniform_windows


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    num_layers = fields["num_hidden_layers"]
    fields["qk_norm"] = True
    fields["sliding_windows"] = (
        uniform_windows(hf, num_layers) if hf.get("use_sliding_window", False) else ()
    )
    fields["moe"] = qwen_moe(hf, num_layers, norm_topk_prob=True)


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    # NOTE: llama.cpp always renormalizes Qwen3-MoE's top-k routing weights.
    qwen_moe_routing(config, get, renormalise=True)


FAMILY = Family(
    "qwen3_moe",
    config=_config,
    gguf=GgufFamily(
        "qwen3moe",
        ArchitectureRules(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            ATTENTION_NAMES
            | QK_NORM_NAMES
            | {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"},
            ROUTED_EXPERT_NAMES,
        ),
        config=_gguf_config,
    ),
)
