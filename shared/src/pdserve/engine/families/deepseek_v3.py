"""DeepSeek-V3 (DeepSeek-V3, DeepSeek-R1, Kimi K2; bfloat16 checkpoints).

Multi-head latent attention (`pdserve.engine.mla`, configured by
`pdserve.engine.hf_config.latent_attention`: the query compressed through ``q_lora_rank`` or
one ``q_proj``, the cache holding the latent alone, YaRN with its mscale on the softmax scale,
RoPE over adjacent pairs reordered at load); dense ``first_k_dense_replace`` layers, then
sigmoid routing with a score correction within the best groups, scaled
(`pdserve.engine.hf_config.sigmoid_group_moe`), with ``n_shared_experts`` as one ungated MLP.
The multi-token-prediction layer is not loaded.

GGUF: ``deepseek2`` files (with sigmoid gating: softmax is DeepSeek-V2's, refused); llama.cpp
stores ``kv_b_proj`` split for its absorbed attention (``attn_k_b``, transposed, and
``attn_v_b``), joined again (older files store ``attn_kv_b`` whole), and writes MLA as
multi-query attention over the latent: ``*_length_mla`` hold the per-head sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pdserve.engine.checkpoint_names import (
    GATE_SCORE_CORRECTION,
    SHARED_EXPERTS,
    without_trailing_layers,
)
from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import (
    DENSE_FFN_NAMES,
    ROUTED_EXPERT_NAMES,
    SHARED_EXPERTS_NAMES,
    ArchitectureRules,
)
from pdserve.engine.gguf_config import sigmoid_group_routing
from pdserve.engine.hf_config import latent_attention, rotary_dim, sigmoid_group_moe

# NOTE: llama.cpp's converter writes DeepSeek's YaRN mscale_all_dim as 0.1 * mscale_all_dim.
DEEPSEEK2_YARN_LOG_MUL_PER_MSCALE = 0.1


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    # NOTE: as transformers: the RoPE tables span the rotated dims of a head only.
    fields["head_dim"] = int(hf["qk_rope_head_dim"])
    fields["rotary_dim"] = rotary_dim(hf, fields["head_dim"])
    fields["mla"] = latent_attention(hf, fields["rope"])
    fields["moe"] = sigmoid_group_moe(hf, fields["num_hidden_layers"])


def _join_kv_b(hf_suffix: str, pieces: Mapping[str, np.ndarray]) -> np.ndarray:
    """DeepSeek's ``kv_b_proj`` (``[heads * (nope + v), kv_lora_rank]``) from llama.cpp's
    ``attn_k_b`` (``[heads, kv_lora_rank, nope]``) and ``attn_v_b`` (``[heads, v,
    kv_lora_rank]``)."""
    k_b, v_b = pieces["k_b"], pieces["v_b"]
    joined = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1)
    return np.ascontiguousarray(joined.reshape(-1, joined.shape[-1]))


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    """DeepSeek-V3's MLA from llama.cpp's keys. The converter writes MLA as multi-query
    attention over the latent (one KV head, keys of ``kv_lora_rank + qk_rope_head_dim``);
    ``key_length_mla`` and ``value_length_mla`` give the per-head sizes (older files, with
    ``attn_kv_b`` whole, give them as ``key_length`` and ``value_length``)."""
    sigmoid_group_routing(config, get, "deepseek2")
    num_mtp_layers = int(get("nextn_predict_layers", 0))
    config["num_hidden_layers"] -= num_mtp_layers
    config["num_nextn_predict_layers"] = num_mtp_layers
    config["num_key_value_heads"] = config["num_attention_heads"]
    config["intermediate_size"] = int(get("feed_forward_length"))
    q_lora_rank = get("attention.q_lora_rank", 0)
    config["q_lora_rank"] = int(q_lora_rank) if q_lora_rank else None
    config["kv_lora_rank"] = int(get("attention.kv_lora_rank"))
    rope_dims = int(get("rope.dimension_count"))
    key_length = int(get("attention.key_length_mla", 0))
    value_length = int(get("attention.value_length_mla", 0))
    if not key_length:
        key_length = int(get("attention.key_length"))
        value_length = int(get("attention.value_length"))
    config["qk_rope_head_dim"] = rope_dims
    config["qk_nope_head_dim"] = key_length - rope_dims
    config["qk_head_dim"] = key_length
    config["v_head_dim"] = value_length
    config["head_dim"] = rope_dims
    config["rope_interleave"] = True
    config["scoring_func"] = "sigmoid"
    config["topk_method"] = "noaux_tc"
    log_mul = float(get("rope.scaling.yarn_log_multiplier", 0.0))
    if "rope_scaling" in config and log_mul:
        mscale = round(log_mul / DEEPSEEK2_YARN_LOG_MUL_PER_MSCALE, 6)
        # NOTE: llama.cpp has one mscale for both: the cos/sin factor is 1.
        config["rope_scaling"] |= {"mscale": mscale, "mscale_all_dim": mscale}


FAMILY = Family(
    "deepseek_v3",
    config=_config,
    renames=(SHARED_EXPERTS, GATE_SCORE_CORRECTION),
    load_tensor=without_trailing_layers,
    gguf=GgufFamily(
        "deepseek2",
        ArchitectureRules(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            {
                "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj",
                "attn_q_a": "self_attn.q_a_proj",
                "attn_q_a_norm": "self_attn.q_a_layernorm",
                "attn_q_b": "self_attn.q_b_proj",
                "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                "attn_kv_a_norm": "self_attn.kv_a_layernorm",
                "attn_kv_b": "self_attn.kv_b_proj",
                "attn_output": "self_attn.o_proj",
                "ffn_gate_inp": "mlp.gate",
            }
            | DENSE_FFN_NAMES
            | SHARED_EXPERTS_NAMES,
            ROUTED_EXPERT_NAMES,
            exact_names={"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
            pieces={
                "attn_k_b.weight": ("self_attn.kv_b_proj.weight", "k_b"),
                "attn_v_b.weight": ("self_attn.kv_b_proj.weight", "v_b"),
            },
            join=_join_kv_b,
            has_mtp_layers=True,
        ),
        config=_gguf_config,
    ),
)
