"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4-mini): Llama with q/k/v and gate/up fused in the
checkpoint, RoPE over the leading ``partial_rotary_factor`` of each head, and a sliding window
on every layer.

GGUF: ``phi3`` files, the fused projections kept; ``rope.dimension_count`` gives the rotated
part, ``attention.sliding_window`` 0 no window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import DENSE_LAYER_NAMES, ArchitectureRules
from pdserve.engine.hf_config import uniform_windows


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    fields["sliding_windows"] = uniform_windows(hf, fields["num_hidden_layers"])


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    del config["head_dim"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary_dim = int(get("rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        config["partial_rotary_factor"] = rotary_dim / head_dim
    config["sliding_window"] = get("attention.sliding_window", 0) or None
    config["original_max_position_embeddings"] = int(
        get("rope.scaling.original_context_length", config["max_position_embeddings"])
    )


FAMILY = Family(
    "phi3",
    config=_config,
    gguf=GgufFamily(
        "phi3",
        ArchitectureRules(
            "phi3",
            "Phi3ForCausalLM",
            DENSE_LAYER_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        ),
        config=_gguf_config,
    ),
)
