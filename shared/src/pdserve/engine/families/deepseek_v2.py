"""DeepSeek-V2 (DeepSeek-V2, DeepSeek-V2-Lite, DeepSeek-Coder-V2; bfloat16 checkpoints).

DeepSeek-V3's latent attention (`pdserve.engine.hf_config.latent_attention`: the query
compressed or one ``q_proj``, as V2-Lite), its cache, YaRN and adjacent-pair RoPE; dense
``first_k_dense_replace`` layers, then softmax routing: the top-k of all experts
(``topk_method: greedy``) or within the ``topk_group`` best of ``n_group`` groups, each scored
by its best expert (``group_limited_greedy``), weighted by the probabilities unrenormalised (as
transformers routes it, whatever ``norm_topk_prob`` says) and scaled by
``routed_scaling_factor``; ``n_shared_experts`` as one ungated MLP.

GGUF: none (a softmax-gated ``deepseek2`` file is refused by DeepSeek-V3's rules).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.engine.arch_config import MoeConfig
from pdserve.engine.checkpoint_names import SHARED_EXPERTS
from pdserve.engine.families import Family
from pdserve.engine.hf_config import latent_attention, rotary_dim


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    # NOTE: as transformers: the RoPE tables span the rotated dims of a head only.
    fields["head_dim"] = int(hf["qk_rope_head_dim"])
    fields["rotary_dim"] = rotary_dim(hf, fields["head_dim"])
    fields["mla"] = latent_attention(hf, fields["rope"])
    fields["moe"] = _moe(hf, fields["num_hidden_layers"])


def _moe(hf: Mapping[str, Any], num_layers: int) -> MoeConfig:
    topk_method = str(hf.get("topk_method", "greedy"))
    if topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 topk_method {topk_method!r} is not supported")
    is_grouped = topk_method == "group_limited_greedy"
    expert_size = int(hf["moe_intermediate_size"])
    first_moe = int(hf.get("first_k_dense_replace", 0))
    return MoeConfig(
        num_experts=int(hf.get("n_routed_experts") or 64),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 6)),
        moe_intermediate_size=expert_size,
        norm_topk_prob=False,
        moe_layers=tuple(i >= first_moe for i in range(num_layers)),
        shared_expert_intermediate_size=expert_size * int(hf.get("n_shared_experts", 2)),
        is_weighting_in_float32=True,
        is_shared_expert_gated=False,
        num_groups=int(hf.get("n_group") or 1) if is_grouped else 1,
        topk_groups=int(hf.get("topk_group") or 1) if is_grouped else 1,
        group_score="max",
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


FAMILY = Family("deepseek_v2", config=_config, renames=(SHARED_EXPERTS,))
