"""ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B): ERNIE 4.5's attention and RoPE
(biases with ``use_bias``, adjacent pairs), experts on every ``moe_layer_interval``-th layer
from ``moe_layer_start_index`` to ``moe_layer_end_index``: a softmax router whose top-k is
chosen on the probabilities plus ``e_score_correction_bias`` and weighted by the probabilities
alone, renormalised (at least ``moe_norm_min``); ``moe_num_shared_experts`` always-on experts
as one ungated MLP. The multi-token-prediction layers are not loaded.

GGUF: ``ernie4_5-moe`` files; the score correction is ``exp_probs_b``; the experts run from
the first sparse layer to the last (llama.cpp writes no end).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pdserve.engine.arch_config import MoeConfig
from pdserve.engine.checkpoint_names import SHARED_EXPERTS
from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import (
    DENSE_LAYER_NAMES,
    ROUTED_EXPERT_NAMES,
    SHARED_EXPERTS_NAMES,
    ArchitectureRules,
)
from pdserve.engine.hf_config import ernie_fields


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    ernie_fields(hf, fields)
    fields["moe"] = _moe(hf, fields["num_hidden_layers"])


def _moe(hf: Mapping[str, Any], num_layers: int) -> MoeConfig:
    start = int(hf.get("moe_layer_start_index", 1))
    end = int(hf.get("moe_layer_end_index", -1))
    end = num_layers - 1 if end == -1 else end
    interval = int(hf.get("moe_layer_interval", 1))
    expert_size = int(hf["moe_intermediate_size"])
    return MoeConfig(
        num_experts=int(hf.get("moe_num_experts") or hf.get("num_experts") or 64),
        num_experts_per_tok=int(hf.get("moe_k") or hf.get("num_experts_per_tok") or 6),
        moe_intermediate_size=expert_size,
        norm_topk_prob=True,
        moe_layers=tuple((i + 1) % interval == 0 and start <= i <= end for i in range(num_layers)),
        shared_expert_intermediate_size=expert_size * int(hf.get("moe_num_shared_experts", 0)),
        is_shared_expert_gated=False,
        has_score_correction=True,
        norm_min=float(hf.get("moe_norm_min", 1e-12)),
    )


def _load_tensor(name: str, tensor: Any, config: Any) -> Any:
    # NOTE: ERNIE's multi-token-prediction layers (for speculation) are not served.
    return None if "mtp" in name else tensor


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    # NOTE: ERNIE 4.5 has one switch for the biases of every projection.
    config["use_bias"] = config.pop("attention_bias")
    config["moe_num_experts"] = int(get("expert_count"))
    config["moe_k"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    config["moe_num_shared_experts"] = int(get("expert_shared_count", 0))
    config["moe_layer_start_index"] = int(get("leading_dense_block_count", 0))
    config["moe_layer_interval"] = int(get("interleave_moe_layer_step", 1))
    # NOTE: llama.cpp runs experts from the first sparse layer to the last layer.
    config["moe_layer_end_index"] = -1


FAMILY = Family(
    "ernie4_5_moe",
    config=_config,
    renames=(
        SHARED_EXPERTS,
        (
            re.compile(r"\.mlp\.(gate\.)?moe_statics\.e_score_correction_bias$"),
            ".mlp.score_correction",
        ),
    ),
    load_tensor=_load_tensor,
    gguf=GgufFamily(
        "ernie4_5-moe",
        ArchitectureRules(
            "ernie4_5_moe",
            "Ernie4_5_MoeForCausalLM",
            DENSE_LAYER_NAMES | SHARED_EXPERTS_NAMES | {"ffn_gate_inp": "mlp.gate"},
            ROUTED_EXPERT_NAMES,
            exact_names={"exp_probs_b.bias": "mlp.moe_statics.e_score_correction_bias"},
        ),
        config=_gguf_config,
    ),
)
