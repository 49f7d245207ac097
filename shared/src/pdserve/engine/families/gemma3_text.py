"""Gemma 3 (the text model: Gemma 3 1B, and the language model of the larger ones).

GeGLU (``gelu_pytorch_tanh``), embeddings scaled by ``sqrt(hidden_size)``, Gemma's
``x * (1 + w)`` RMSNorm, norms before and after both blocks (its own decoder layer, here),
q/k norm, ``query_pre_attn_scalar``, interleaved sliding layers (a RoPE of their own, by
default base 10000) and global ones (a scaled RoPE), final logit soft-capping; embeddings tied
by default.

GGUF: ``gemma3`` files; llama.cpp adds 1 to every norm weight, which is taken off again; the
layer pattern (five sliding layers, then a global one) and the query scale
(``1/sqrt(head_dim)``, the 27B model excepted) are llama.cpp's, as the file may not say them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.arch_config import RopeConfig
from pdserve.engine.decoder import DecoderLayer, NormPlaces
from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import DENSE_LAYER_NAMES, QK_NORM_NAMES, ArchitectureRules
from pdserve.engine.hf_config import layer_windows

# NOTE: llama.cpp hardcodes Gemma 3's layer pattern (five sliding-window layers, then a global
# one) and the sliding layers' RoPE base; newer files may state them, older ones do not.
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_NUM_LAYERS = 62


class GemmaDecoderLayer(DecoderLayer):
    """Gemma 3's layer: each block normed before and after, then added to the residual."""

    norms = NormPlaces(
        attention_input="input_layernorm",
        attention_output="post_attention_layernorm",
        feed_forward_input="pre_feedforward_layernorm",
        feed_forward_output="post_feedforward_layernorm",
    )


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    num_layers = fields["num_hidden_layers"]
    softcap = hf.get("final_logit_softcapping")
    fields.update(
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qk_norm=True,
        gemma_norms=True,
        embed_scale=fields["hidden_size"] ** 0.5,
        attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcapping=None if softcap is None else float(softcap),
    )
    fields["rope"], fields["local_rope"] = _ropes(hf)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    fields["sliding_windows"] = layer_windows(hf, num_layers, layer_types)


def _ropes(hf: Mapping[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """The RoPE of full-attention layers and that of sliding layers."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {"rope_theta": 1_000_000.0}
        local = params.get("sliding_attention") or {"rope_theta": 10_000.0}
        return RopeConfig.from_hf({"rope_parameters": full}), RopeConfig.from_hf(
            {"rope_parameters": local}
        )
    # NOTE: checkpoints written before transformers 5 give the global RoPE as rope_theta +
    # rope_scaling and the local base as rope_local_base_freq (never scaled).
    global_rope = RopeConfig.from_hf(
        {
            "rope_theta": hf.get("rope_theta", 1_000_000.0),
            "rope_scaling": hf.get("rope_scaling"),
        }
    )
    return global_rope, RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    num_layers = config["num_hidden_layers"]
    del config["hidden_act"]
    config["hidden_activation"] = "gelu_pytorch_tanh"
    config["sliding_window"] = int(get("attention.sliding_window"))
    config["rope_local_base_freq"] = float(get("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE))
    # NOTE: llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B model (62 layers),
    # which uses hidden_size / num_heads, as its Hugging Face config does.
    scalar = config["head_dim"]
    if num_layers == GEMMA3_27B_NUM_LAYERS:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    config["query_pre_attn_scalar"] = scalar
    softcap = get("final_logit_softcapping", 0.0)
    config["final_logit_softcapping"] = float(softcap) if softcap else None
    pattern = get("attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):
        # one flag per layer, true for a sliding-window layer
        is_sliding = [bool(flag) for flag in pattern]
    else:
        config["sliding_window_pattern"] = int(pattern)
        is_sliding = [(layer + 1) % int(pattern) != 0 for layer in range(num_layers)]
    config["layer_types"] = [
        "sliding_attention" if sliding else "full_attention" for sliding in is_sliding
    ]


FAMILY = Family(
    "gemma3_text",
    config=_config,
    decoder_layer=GemmaDecoderLayer,
    gguf=GgufFamily(
        "gemma3",
        ArchitectureRules(
            "gemma3_text",
            "Gemma3ForCausalLM",
            DENSE_LAYER_NAMES
            | QK_NORM_NAMES
            | {
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            },
            norm_offset=1.0,
        ),
        config=_gguf_config,
    ),
    refused={"gemma3": "the multimodal Gemma 3: serve a text-only gemma3_text checkpoint"},
)
