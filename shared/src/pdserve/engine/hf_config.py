"""The rules every family shares for reading a Hugging Face ``config.json`` into the fields of
a `ModelConfig`, and the building blocks several families' own rules use.

`shared_fields` reads a config as Llama's does in transformers; each family's module
(`pdserve.engine.families`) then sets what its own configuration means otherwise (which
projections carry a bias, which layers slide, which feed-forwards are experts). A setting the
engine does not implement is refused at load, with a message that names it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.engine.arch_config import MlaConfig, MoeConfig, RopeConfig, yarn_mscale


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def shared_fields(hf: Mapping[str, Any], generation: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `ModelConfig` fields of a parsed ``config.json`` (and ``generation_config.json``)
    as Llama reads them: what a family's own rules start from."""
    num_layers = int(hf["num_hidden_layers"])
    num_heads = int(hf["num_attention_heads"])
    hidden_size = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden_size // num_heads)
    attention_bias = bool(hf.get("attention_bias", False))
    eos = _as_id_tuple(hf.get("eos_token_id"))
    if generation:
        eos = tuple(dict.fromkeys(eos + _as_id_tuple(generation.get("eos_token_id"))))
    return dict(
        model_type=str(hf.get("model_type", "")),
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        rope=RopeConfig.from_hf(hf),
        sliding_windows=layer_windows(hf, num_layers),
        eos_token_ids=eos,
        bos_token_id=hf.get("bos_token_id"),
        torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu"),
        rotary_dim=rotary_dim(hf, head_dim),
    )


def rotary_dim(hf: Mapping[str, Any], head_dim: int, default: float = 1.0) -> int | None:
    """How many leading dims of a head RoPE rotates (``partial_rotary_factor``, `default` when
    the config has none); None for all of them."""
    params = hf.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default)))
    return None if factor == 1.0 else int(head_dim * factor)


def layer_windows(
    hf: Mapping[str, Any], num_layers: int, layer_types: Sequence[str] | None = None
) -> tuple[int | None, ...]:
    """Per-layer sliding windows: ``sliding_window`` on the layers ``layer_types`` (the
    config's when not given) marks ``sliding_attention``, on every layer without them; none
    without a window."""
    window = hf.get("sliding_window")
    if not window:
        return ()
    if layer_types is None:
        layer_types = hf.get("layer_types")
    if layer_types is None:
        return uniform_windows(hf, num_layers)
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def uniform_windows(hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """``sliding_window`` on every layer (whatever ``layer_types`` says); none without one."""
    window = hf.get("sliding_window")
    return tuple(int(window) for _ in range(num_layers)) if window else ()


def max_window_layers_windows(hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Qwen2's and Qwen3's windows: with ``use_sliding_window``, on the layers ``layer_types``
    marks or, without them, on every layer from ``max_window_layers`` on."""
    window = hf.get("sliding_window")
    if not hf.get("use_sliding_window", False) or not window:
        return ()
    if hf.get("layer_types") is not None:
        return layer_windows(hf, num_layers)
    first_sliding = int(hf.get("max_window_layers", num_layers))
    return tuple(int(window) if i >= first_sliding else None for i in range(num_layers))


def opt_in_windows(hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """The windows of a family whose window applies only with ``use_sliding_window`` (Qwen,
    SmolLM3)."""
    return layer_windows(hf, num_layers) if hf.get("use_sliding_window", False) else ()


def sigmoid_group_moe(hf: Mapping[str, Any], num_layers: int) -> MoeConfig:
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


def qwen_moe(
    hf: Mapping[str, Any],
    num_layers: int,
    norm_topk_prob: bool,
    shared_expert_intermediate_size: int = 0,
) -> MoeConfig:
    """Qwen-MoE's experts: on every ``decoder_sparse_step``-th layer but ``mlp_only_layers``,
    softmax routing renormalised with ``norm_topk_prob`` (`norm_topk_prob` when the config
    does not say)."""
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    dense_layers = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step", 1))
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", norm_topk_prob)),
        moe_layers=tuple(
            i not in dense_layers and num_experts > 0 and (i + 1) % step == 0
            for i in range(num_layers)
        ),
        shared_expert_intermediate_size=shared_expert_intermediate_size,
    )


def latent_attention(hf: Mapping[str, Any], rope: RopeConfig) -> MlaConfig:
    """DeepSeek's multi-head latent attention (V2 and V3); its softmax scale takes YaRN's
    mscale twice (``mscale_all_dim``), as transformers' ``yarn_apply_mscale``."""
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


def ernie_fields(hf: Mapping[str, Any], fields: dict[str, Any]) -> None:
    """ERNIE 4.5's attention and embeddings (dense and MoE): one ``use_bias`` for every
    projection's bias, embeddings tied unless said otherwise, RoPE over adjacent pairs."""
    use_bias = bool(hf.get("use_bias", False))
    fields["qkv_bias"] = fields["o_proj_bias"] = fields["qkv_bias"] or use_bias
    fields["mlp_bias"] = fields["mlp_bias"] or use_bias
    fields["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    fields["is_rope_interleaved"] = True
