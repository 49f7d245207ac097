"""Mixtral: Llama's attention with a sliding window on every layer, and a sparse MoE on every
layer: a softmax router, the top-k experts, their weights renormalised. The checkpoint names
the block ``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3`` (up) and
``w2`` (down).

GGUF: ``llama`` files with ``llama.expert_count`` above 0; the experts stacked in
``ffn_*_exps`` (or, in files from before 2024, one ``ffn_gate.E`` tensor per expert).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pdserve.engine.arch_config import MoeConfig
from pdserve.engine.families import ConfigGetter, Family, GgufFamily
from pdserve.engine.gguf_architectures import ATTENTION_NAMES, ArchitectureRules
from pdserve.engine.hf_config import uniform_windows

_EXPERTS = {
    "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
    "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
    "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3",
    # NOTE: Mixtral files from before 2024 store one 2-D tensor per expert (blk.N.ffn_gate.E).
    "ffn_gate": "block_sparse_moe.experts.{expert}.w1",
    "ffn_down": "block_sparse_moe.experts.{expert}.w2",
    "ffn_up": "block_sparse_moe.experts.{expert}.w3",
}


def _config(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    num_layers = fields["num_hidden_layers"]
    fields["sliding_windows"] = uniform_windows(hf, num_layers)
    fields["moe"] = MoeConfig(
        num_experts=int(hf.get("num_local_experts", 8)),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(hf["intermediate_size"]),
        norm_topk_prob=True,
        moe_layers=(True,) * num_layers,
        is_weighting_in_float32=True,
    )


def _claims(metadata: Mapping[str, Any]) -> bool:
    return int(metadata.get("llama.expert_count") or 0) > 0


def _gguf_config(config: dict[str, Any], get: ConfigGetter, tensors: set[str]) -> None:
    config["num_local_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))


FAMILY = Family(
    "mixtral",
    config=_config,
    renames=(
        (re.compile(r"\.block_sparse_moe\."), ".mlp."),
        (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
        (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
        (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
    ),
    gguf=GgufFamily(
        "llama",
        ArchitectureRules(
            "mixtral",
            "MixtralForCausalLM",
            ATTENTION_NAMES
            | {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "block_sparse_moe.gate"},
            _EXPERTS,
            is_qk_permuted=True,
        ),
        config=_gguf_config,
        claims=_claims,
        reads_rope_freqs=True,
    ),
)
