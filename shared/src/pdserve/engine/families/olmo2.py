"""OLMo 2: Llama's attention and SwiGLU with an RMSNorm after each block (on its output,
before the residual add: its own decoder layer, here) and none before it, and an RMSNorm over
all of q and all of k (not per head) before RoPE.

GGUF: ``olmo2`` files, unpermuted; the converter writes OLMo 3 as ``olmo2`` too, with a
sliding window, which is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.decoder import CosSin, LlamaAttention, feed_forward
from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import ATTENTION_NAMES, QK_NORM_NAMES, ArchitectureRules
from pdserve.engine.layers import make_norm
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel.group import TensorParallelGroup


class Olmo2DecoderLayer(nn.Module):
    """OLMo 2's layer: each block's output normed, then added to the residual (no input norm)."""

    def __init__(
        self, config: ModelConfig, layer_index: int, backend: str, group: TensorParallelGroup
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, backend, group)
        self.mlp = feed_forward(config, layer_index, group)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.post_feedforward_layernorm = make_norm(config, config.hidden_size)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: CosSin | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        attended = self.self_attn(hidden, rope, kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


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
    decoder_layer=Olmo2DecoderLayer,
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
