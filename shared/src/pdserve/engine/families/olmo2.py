"""OLMo 2: Llama's attention and SwiGLU with an RMSNorm after each block (on its output,
before the residual add: `PostNormDecoderLayer`) and none before it, and an RMSNorm over
all of q and all of k (not per head) before RoPE.

GGUF: ``olmo2`` files, unpermuted; the converter writes OLMo 3 as ``olmo2`` too, with a
sliding window, which is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.decoder import PostNormDecoderLayer
from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import ATTENTION_NAMES, QK_NORM_NAMES, ArchitectureRules


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    fields["qk_norm"] = True
    fields["is_qk_norm_across_heads"] = True


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    # NOTE: llama.cpp's converter writes OLMo 3 as an olmo2 file with sliding-window layers.
    if get("attention.sliding_window", 0):
        raise ValueError(
            "an olmo2 GGUF file with a sliding window (OLMo 3) is not supported; "
            "OLMo 2 is (no attention.sliding_window)"
        )


FAMILY = Family(
    "olmo2",
    config=_config,
    # NOTE: each block's output normed, then added to the residual (no input norm).
    decoder_layer=PostNormDecoderLayer,
    gguf=GgufFamily(
        "olmo2",
        ArchitectureRules(
            "olmo2",
            "Olmo2ForCausalLM",
            ATTENTION_NAMES
            | QK_NORM_NAMES
            | {
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
                "ffn_gate": "mlp.gate_proj",
                "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj",
            },
        ),
        config=_gguf_config,
    ),
)
