"""GLM-4.5 (GLM-4.5, GLM-4.5-Air): RoPE over the leading ``partial_rotary_factor`` of each
head (0.5 by default), a q/k/v bias with ``attention_bias`` (none on the output projection),
optional per-head q/k norm (``use_qk_norm``); dense ``first_k_dense_replace`` layers, then
DeepSeek-V3's routing (`pdserve.engine.hf_config.sigmoid_group_moe`) with
``n_shared_experts`` as one ungated MLP. The multi-token-prediction layers after the last are
not loaded.

GGUF: ``glm4moe`` files; the score correction is ``exp_probs_b``; the converter counts the
multi-token-prediction layers in ``block_count`` (``nextn_predict_layers``): left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.checkpoint_names import (
    GATE_SCORE_CORRECTION,
    SHARED_EXPERTS,
    without_trailing_layers,
)
from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import (
    ATTENTION_NAMES,
    DENSE_FFN_NAMES,
    QK_NORM_NAMES,
    ROUTED_EXPERT_NAMES,
    SHARED_EXPERTS_NAMES,
    ArchitectureRules,
)
from pdserve.engine.gguf_config import sigmoid_group_routing
from pdserve.engine.hf_config import rotary_dim, sigmoid_group_moe


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    fields["o_proj_bias"] = False
    fields["qk_norm"] = bool(hf.get("use_qk_norm"))
    fields["rotary_dim"] = rotary_dim(hf, fields["head_dim"], default=0.5)
    fields["moe"] = sigmoid_group_moe(hf, fields["num_hidden_layers"])


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    sigmoid_group_routing(config, get, "glm4moe")
    # NOTE: the converter counts the multi-token-prediction layers in block_count.
    num_mtp_layers = int(get("nextn_predict_layers", 0))
    config["num_hidden_layers"] -= num_mtp_layers
    config["num_nextn_predict_layers"] = num_mtp_layers
    config["partial_rotary_factor"] = int(get("rope.dimension_count")) / config["head_dim"]
    config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in tensors


FAMILY = Family(
    "glm4_moe",
    config=_config,
    renames=(SHARED_EXPERTS, GATE_SCORE_CORRECTION),
    load_tensor=without_trailing_layers,
    gguf=GgufFamily(
        "glm4moe",
        ArchitectureRules(
            "glm4_moe",
            "Glm4MoeForCausalLM",
            ATTENTION_NAMES
            | QK_NORM_NAMES
            | DENSE_FFN_NAMES
            | SHARED_EXPERTS_NAMES
            | {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"},
            ROUTED_EXPERT_NAMES,
            exact_names={"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"},
            has_mtp_layers=True,
        ),
        config=_gguf_config,
    ),
)
