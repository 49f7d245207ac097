"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-MoE): Qwen2's attention (q/k/v bias) and experts on every
``decoder_sparse_step``-th layer but ``mlp_only_layers``, renormalised with
``norm_topk_prob``, with a shared expert scaled by a sigmoid gate; a sliding window only with
``use_sliding_window``.

GGUF: ``qwen2moe`` files, the experts stacked; the converter writes no
``expert_weights_norm``, and llama.cpp then leaves the top-k weights as the softmax gives them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import (
    ATTENTION_NAMES,
    ROUTED_EXPERT_NAMES,
    SHARED_EXPERT_NAMES,
    ArchitectureRules,
)
from pdserve.engine.gguf_config import qwen_moe_routing
from pdserve.engine.hf_config import opt_in_windows, qwen_moe


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    num_layers = fields["num_hidden_layers"]
    fields["qkv_bias"] = fields["qkv_bias"] or hf.get("qkv_bias", True) is not False
    fields["sliding_windows"] = opt_in_windows(hf, num_layers)
    fields["moe"] = qwen_moe(
        hf,
        num_layers,
        norm_topk_prob=False,
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
    )


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    config["attention_bias"] = False
    qwen_moe_routing(config, get, renormalise=False)
    config["shared_expert_intermediate_size"] = int(get("expert_shared_feed_forward_length"))


FAMILY = Family(
    "qwen2_moe",
    config=_config,
    gguf=GgufFamily(
        "qwen2moe",
        ArchitectureRules(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            ATTENTION_NAMES
            | SHARED_EXPERT_NAMES
            | {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"},
            ROUTED_EXPERT_NAMES,
        ),
        config=_gguf_config,
    ),
)
