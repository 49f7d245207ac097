"""Reads a Hugging Face ``config.json`` into the fields of a `ModelConfig`, one rule set per
family.

Each family's rules follow that family's configuration and modeling code in transformers:
which projections carry a bias, which layers slide, which feed-forwards are experts, and how
Gemma 3 spells its two RoPEs. A setting the engine does not implement is refused here, at
load, with a message that names it.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.arch_config import (
    SUPPORTED_MODEL_TYPES,
    MlaConfig,
    MoeConfig,
    RopeConfig,
    yarn_mscale,
)

_QWEN_FAMILY = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
_QK_NORM_FAMILY = ("qwen3", "qwen3_moe", "gemma3_text", "olmo2")
_DEFAULT_PARTIAL_ROTARY = {"glm4_moe": 0.5}


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _refuse_unknown(model_type: str) -> None:
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    hint = ""
    if model_type == "gemma3":
        hint = " (the multimodal Gemma 3: serve a text-only gemma3_text checkpoint)"
    raise ValueError(
        f"unsupported model_type {model_type!r}{hint}; "
        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def model_config_fields(hf: dict[str, Any], generation: dict[str, Any] | None) -> dict[str, Any]:
    """The `ModelConfig` fields of a parsed ``config.json`` (and ``generation_config.json``).

    Raises:
        ValueError: For an unknown ``model_type`` or a setting the engine does not implement.
    """
    model_type = str(hf.get("model_type", ""))
    _refuse_unknown(model_type)
    num_layers = int(hf["num_hidden_layers"])
    num_heads = int(hf["num_attention_heads"])
    hidden_size = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden_size // num_heads)
    is_mla = model_type in ("deepseek_v2", "deepseek_v3")
    if is_mla:
        # NOTE: as transformers: the RoPE tables span the rotated dims of a head only.
        head_dim = int(hf["qk_rope_head_dim"])
    is_gemma = model_type == "gemma3_text"
    hidden_act = str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu")
    is_ernie = model_type in ("ernie4_5", "ernie4_5_moe")
    attention_bias = bool(hf.get("attention_bias", False)) or (
        is_ernie and bool(hf.get("use_bias", False))
    )
    eos = _as_id_tuple(hf.get("eos_token_id"))
    if generation:
        eos = tuple(dict.fromkeys(eos + _as_id_tuple(generation.get("eos_token_id"))))
    rope, local_rope = _ropes(hf, model_type)
    return dict(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", is_gemma or is_ernie)),
        qkv_bias=attention_bias
        or (model_type in ("qwen2", "qwen2_moe") and hf.get("qkv_bias", True) is not False),
        o_proj_bias=attention_bias and model_type != "glm4_moe",
        mlp_bias=bool(hf.get("mlp_bias", False)) or (is_ernie and bool(hf.get("use_bias"))),
        rope=rope,
        sliding_windows=_sliding_windows(hf, model_type, num_layers),
        eos_token_ids=eos,
        bos_token_id=hf.get("bos_token_id"),
        torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        hidden_act=hidden_act,
        qk_norm=model_type in _QK_NORM_FAMILY
        or (model_type == "glm4_moe" and bool(hf.get("use_qk_norm"))),
        is_qk_norm_across_heads=model_type == "olmo2",
        is_post_norm=model_type == "olmo2",
        rope_layers=_rope_layers(hf, model_type, num_layers),
        gemma_norms=is_gemma,
        embed_scale=hidden_size**0.5 if is_gemma else None,
        attention_scale=_attention_scale(hf) if is_gemma else None,
        final_logit_softcapping=_final_softcap(hf) if is_gemma else None,
        rotary_dim=_rotary_dim(hf, head_dim, _DEFAULT_PARTIAL_ROTARY.get(model_type, 1.0)),
        is_rope_interleaved=is_ernie,
        has_attention_sinks=model_type == "gpt_oss",
        local_rope=local_rope,
        moe=_moe(hf, model_type, num_layers),
        mla=_mla(hf, rope) if is_mla else None,
    )


def _attention_scale(hf: dict[str, Any]) -> float:
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit soft-capping (attn_logit_softcapping) is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (use_bidirectional_attention) is not supported")
    return float(hf.get("query_pre_attn_scalar", 256)) ** -0.5


def _final_softcap(hf: dict[str, Any]) -> float | None:
    value = hf.get("final_logit_softcapping")
    return None if value is None else float(value)


def _rotary_dim(hf: dict[str, Any], head_dim: int, default: float = 1.0) -> int | None:
    params = hf.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default)))
    return None if factor == 1.0 else int(head_dim * factor)


def _ropes(hf: dict[str, Any], model_type: str) -> tuple[RopeConfig, RopeConfig | None]:
    """The RoPE of full-attention layers and, for Gemma 3, that of sliding layers."""
    if model_type != "gemma3_text":
        return RopeConfig.from_hf(hf), None
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


def _rope_layers(hf: dict[str, Any], model_type: str, num_layers: int) -> tuple[bool, ...]:
    """SmolLM3's ``no_rope_layers``: 1 where a layer uses RoPE (despite the name), by default
    every layer but each ``no_rope_layer_interval``-th."""
    if model_type != "smollm3":
        return ()
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        flags = [(i + 1) % interval != 0 for i in range(num_layers)]
    return tuple(bool(flag) for flag in flags)


def _moe(hf: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
    if model_type == "mixtral":
        return MoeConfig(
            num_experts=int(hf.get("num_local_experts", 8)),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            moe_layers=(True,) * num_layers,
            is_weighting_in_float32=True,
        )
    if model_type == "ernie4_5_moe":
        return _ernie_moe(hf, num_layers)
    if model_type in ("glm4_moe", "deepseek_v3"):
        return _deepseek_style_moe(hf, num_layers)
    if model_type == "deepseek_v2":
        return _deepseek_v2_moe(hf, num_layers)
    if model_type == "gpt_oss":
        return MoeConfig(
            num_experts=int(hf.get("num_local_experts", 32)),
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 4)),
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=False,
            moe_layers=(True,) * num_layers,
            scoring="top_logits",
            router_bias=True,
            expert_bias=True,
            clamped_swiglu=(
                float(hf.get("swiglu_alpha", 1.702)),
                float(hf.get("swiglu_limit", 7.0)),
            ),
        )
    if model_type not in ("qwen2_moe", "qwen3_moe"):
        return None
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    dense_layers = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step", 1))
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", model_type == "qwen3_moe")),
        moe_layers=tuple(
            i not in dense_layers and num_experts > 0 and (i + 1) % step == 0
            for i in range(num_layers)
        ),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe"
        else 0,
    )


def _ernie_moe(hf: dict[str, Any], num_layers: int) -> MoeConfig:
    """ERNIE 4.5's experts: every ``moe_layer_interval``-th layer from ``moe_layer_start_index``
    to ``moe_layer_end_index`` (-1: the last), softmax routing chosen with a correction bias and
    renormalised, and ``moe_num_shared_experts`` always-on experts as one ungated MLP."""
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


def _mla(hf: dict[str, Any], rope: RopeConfig) -> MlaConfig:
    """DeepSeek-V3's multi-head latent attention; its softmax scale takes YaRN's mscale twice
    (``mscale_all_dim``), as transformers' ``yarn_apply_mscale``."""
    nope, rope_dims = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    scale = (nope + rope_dims) ** -0.5
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    mscale_all_dim = float(params.get("mscale_all_dim") or 0)
    if rope.rope_type != "default" and mscale_all_dim:
        scale = scale * yarn_mscale(rope.factor, mscale_all_dim) ** 2
    q_lora = hf.get("q_lora_rank")
    return MlaConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dims,
        v_head_dim=int(hf["v_head_dim"]),
        is_rope_interleaved=bool(hf.get("rope_interleave", True)),
        softmax_scale=scale,
    )


def _deepseek_style_moe(hf: dict[str, Any], num_layers: int) -> MoeConfig:
    """GLM-4.5's and DeepSeek-V3's experts: dense ``first_k_dense_replace`` layers, then
    sigmoid scores chosen with a correction bias within the best ``topk_group`` of ``n_group``
    groups, renormalised and scaled by ``routed_scaling_factor``; ``n_shared_experts`` as one
    ungated MLP."""
    expert_size = int(hf["moe_intermediate_size"])
    first_moe = int(hf.get("first_k_dense_replace", 1))
    return MoeConfig(
        num_experts=int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 128),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        moe_intermediate_size=expert_size,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_layers=tuple(i >= first_moe for i in range(num_layers)),
        shared_expert_intermediate_size=expert_size * int(hf.get("n_shared_experts", 1)),
        is_weighting_in_float32=True,
        is_shared_expert_gated=False,
        has_score_correction=True,
        norm_min=1e-20,
        scoring="sigmoid",
        num_groups=int(hf.get("n_group", 1)),
        topk_groups=int(hf.get("topk_group", 1)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
    )


def _deepseek_v2_moe(hf: dict[str, Any], num_layers: int) -> MoeConfig:
    """DeepSeek-V2's experts: dense ``first_k_dense_replace`` layers, then softmax scores, the
    top-k of all (``greedy``) or within the ``topk_group`` best of ``n_group`` groups by their
    best score (``group_limited_greedy``), not renormalised (as transformers routes it, whatever
    ``norm_topk_prob`` says) and scaled by ``routed_scaling_factor``; ``n_shared_experts`` as
    one ungated MLP."""
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


def _sliding_windows(
    hf: dict[str, Any], model_type: str, num_layers: int
) -> tuple[int | None, ...]:
    """Per-layer sliding windows, following each architecture's own rules in transformers."""
    window = hf.get("sliding_window")
    if model_type in (*_QWEN_FAMILY, "smollm3") and not hf.get("use_sliding_window", False):
        window = None
    if model_type == "llama" or not window:
        return ()
    layer_types = hf.get("layer_types")
    if model_type == "gemma3_text" and layer_types is None:
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    if model_type in ("qwen2", "qwen3") and layer_types is None:
        first_sliding = int(hf.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first_sliding else None for i in range(num_layers))
    if layer_types is not None and model_type not in ("qwen3_moe", "mixtral", "phi3"):
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return tuple(int(window) for _ in range(num_layers))
