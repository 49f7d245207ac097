"""Tiny random checkpoints of every supported family, built with transformers from a config.

The engine's exactness tests compare against transformers on these; the split and chaos tests
serve them through real prefill and decode services.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

VOCAB_SIZE = 300
# NOTE: a wide initializer spreads the logits, so greedy choices are not near-ties that a
# last-bit difference between two correct implementations could flip.
INIT_RANGE = 0.25

COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "initializer_range": INIT_RANGE,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# DeepSeek's latent attention and expert layout, shared by the V2 and V3 tiny models: a dense
# first layer, then 8 experts in 2 groups of which 1 is chosen, top 2.
_LATENT_MOE: dict[str, Any] = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "moe_intermediate_size": 32,
}

ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA, untied, Llama 3.1 rope scaling with a short original context so it matters.
    "llama3": (
        "llama",
        {
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    # Multi-head attention with tied embeddings.
    "llama_tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    # q/k/v bias, GQA, tied embeddings (as the small Qwen2 checkpoints are).
    "qwen2": ("qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    # One KV head for four query heads and a sliding window shorter than the test sequences.
    "mistral": ("mistral", {"num_key_value_heads": 1, "sliding_window": 24}),
    # RMSNorm on q and k, a head_dim of its own, tied embeddings.
    "qwen3": ("qwen3", {"num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True}),
    # Fused qkv and gate/up in the checkpoint, RoPE over half of each head (Phi-4-mini style).
    "phi3": (
        "phi3",
        {
            "num_key_value_heads": 2,
            "pad_token_id": 0,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        },
    ),
    # Eight experts, two per token, renormalised; a sliding window on every layer.
    "mixtral": (
        "mixtral",
        {
            "num_key_value_heads": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 24,
        },
    ),
    # Experts with q/k norm; the second layer dense (mlp_only_layers).
    "qwen3_moe": (
        "qwen3_moe",
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    # q/k/v bias, unnormalised top-k and a sigmoid-gated shared expert.
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_key_value_heads": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
        },
    ),
    # A sliding layer and a global one with RoPEs of their own (the global one scaled),
    # GeGLU, scaled embeddings, norms around both blocks, q/k norm and final soft-capping.
    "gemma3": (
        "gemma3_text",
        {
            "num_key_value_heads": 2,
            "head_dim": 32,
            "sliding_window": 24,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
            "pad_token_id": 0,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    # Norms after each block (none before), q and k normed across all heads, GQA.
    "olmo2": ("olmo2", {"num_key_value_heads": 2}),
    # Llama without RoPE on every second layer (the interval is 4 in the released model).
    "smollm3": (
        "smollm3",
        {"num_key_value_heads": 2, "no_rope_layer_interval": 2, "pad_token_id": 0},
    ),
    # A bias on every projection (use_bias), RoPE over adjacent pairs, tied embeddings.
    "ernie4_5": (
        "ernie4_5",
        {"num_key_value_heads": 2, "use_bias": True, "tie_word_embeddings": True},
    ),
    # A dense first layer, then 6 experts (top 2) chosen with a score correction, two shared
    # experts as one ungated MLP; ERNIE's RoPE over adjacent pairs.
    "ernie4_5_moe": (
        "ernie4_5_moe",
        {
            "num_key_value_heads": 2,
            "moe_num_experts": 6,
            "moe_k": 2,
            "moe_intermediate_size": 32,
            "moe_num_shared_experts": 2,
            "moe_layer_start_index": 1,
            "tie_word_embeddings": False,
        },
    ),
    # A dense first layer, then DeepSeek-V3's routing: sigmoid scores with a correction, 8
    # experts in 2 groups of which 1 is chosen, top 2, scaled; one shared expert; RoPE over
    # half of each head; q/k norms and a q/k/v bias.
    "glm4_moe": (
        "glm4_moe",
        {
            "num_key_value_heads": 2,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "routed_scaling_factor": 2.5,
            "use_qk_norm": True,
            "attention_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    # Attention sinks, sliding and full layers alternating (a window shorter than the test
    # sequences), YaRN RoPE, a bias everywhere, 4 experts (top 2) with the clamped SwiGLU.
    "gpt_oss": (
        "gpt_oss",
        {
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 24,
            "swiglu_limit": 1.0,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            },
            "tie_word_embeddings": False,
        },
    ),
    # Multi-head latent attention (a compressed query too) with YaRN and its mscale, RoPE over
    # adjacent pairs; a dense first layer, then GLM-4.5's routing with one shared expert.
    "deepseek_v3": (
        "deepseek_v3",
        {
            **_LATENT_MOE,
            "q_lora_rank": 24,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            "tie_word_embeddings": False,
        },
    ),
    # DeepSeek-V2's latent attention without a compressed query (V2-Lite's q_proj), softmax
    # routing limited to the best group by its best score, not renormalised, scaled.
    "deepseek_v2": (
        "deepseek_v2",
        {
            **_LATENT_MOE,
            "q_lora_rank": None,
            "topk_method": "group_limited_greedy",
            "n_shared_experts": 2,
            "routed_scaling_factor": 1.5,
            "tie_word_embeddings": False,
        },
    ),
}

# NOTE: transformers runs gpt-oss's sinks in its eager attention only.
EAGER_ONLY = ("gpt_oss",)


# NOTE: the first four architectures keep the seeds they were tested with; the others are
# seeded by their place in ARCHITECTURES, so new ones go at the end.
_SEEDS = {"llama3": 0, "llama_tied": 1, "mistral": 2, "qwen2": 3}


def build_hf_model(name: str, **overrides: Any) -> torch.nn.Module:
    """A random transformers model of one of ``ARCHITECTURES``, in eval mode.

    Args:
        name: A key of ``ARCHITECTURES``.
        overrides: Config values that replace the common ones (e.g. ``vocab_size``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, extra = ARCHITECTURES[name]
    config = AutoConfig.for_model(kind, **{**COMMON, **extra, **overrides})
    config._attn_implementation = "eager" if kind in EAGER_ONLY else "sdpa"
    torch.manual_seed(_SEEDS.get(name, len(_SEEDS) + list(ARCHITECTURES).index(name)))
    model = AutoModelForCausalLM.from_config(config)
    if kind in ("qwen2", "qwen2_moe"):
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0.0, INIT_RANGE)
    if kind == "ernie4_5":
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, INIT_RANGE)
    if kind == "gpt_oss":
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("bias", ".sinks")):
                    param.normal_(0.0, 0.5 if name.endswith(".sinks") else INIT_RANGE)
                if name.endswith(".router.weight"):
                    # NOTE: logits far enough apart that bf16's rounding rarely swaps an
                    # expert (at the common init a tie decides, in either implementation).
                    param.normal_(0.0, 0.3)
    if kind == "deepseek_v2":
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".mlp.gate.weight"):
                    # NOTE: routing probabilities far enough apart that bf16's rounding rarely
                    # swaps an expert (no correction bias spreads them, as in V3).
                    param.normal_(0.0, 0.3)
    if kind in ("glm4_moe", "deepseek_v3"):
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                if kind == "glm4_moe":
                    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                        proj.bias.normal_(0.0, INIT_RANGE)
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.normal_(0.0, 0.2)
    if kind == "ernie4_5_moe":
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "moe_statics"):
                    # NOTE: large enough to change which experts a token gets.
                    gate.moe_statics.e_score_correction_bias.normal_(0.0, 0.2)
    return model.eval()


# Gemma 3's proportions at a tiny width: five sliding layers of window 512 to one global, and
# positions for a 4k-token prompt (`save_tiny_model("gemma3", path, **GEMMA3_SHAPED)`).
GEMMA3_SHAPED: dict[str, Any] = {
    "num_hidden_layers": 6,
    "sliding_window": 512,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "max_position_embeddings": 8192,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}


def save_tiny_model(name: str, path: Path, **overrides: Any) -> Path:
    """Saves ``build_hf_model(name, **overrides)`` as a safetensors checkpoint at `path`."""
    build_hf_model(name, **overrides).save_pretrained(path, safe_serialization=True)
    return path


def servable_tiny_model(name: str, path: Path, demo_model_dir: Path) -> Path:
    """A tiny model of family `name` with the demo's tokenizer and chat template, so that
    `pdserve up --model` serves it (its vocabulary is the demo's)."""
    from pdserve.engine import demo_tokenizer

    save_tiny_model(
        name,
        path,
        vocab_size=demo_tokenizer.VOCAB_SIZE,
        bos_token_id=demo_tokenizer.BOS_TOKEN_ID,
        eos_token_id=demo_tokenizer.EOS_TOKEN_ID,
        pad_token_id=demo_tokenizer.PAD_TOKEN_ID,
    )
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(demo_model_dir / file, path / file)
    return path


# e2m1: the 4-bit code's value, as the MXFP4 format and transformers' FP4_VALUES give it.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
MXFP4_BLOCK = 32
MXFP4_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`weight` (``[..., rows, cols]``) in MXFP4 as gpt-oss's checkpoints hold it: per 32
    columns an e8m0 scale (``2 ** (scale - 127)``, the block's largest value in [4, 8)) and
    4-bit e2m1 codes, two to a byte, the even column in the low nibble.

    Returns:
        (blocks ``[..., rows, cols / 32, 16]``, scales ``[..., rows, cols / 32]``, the weight
        the two hold).
    """
    groups = weight.reshape(*weight.shape[:-1], -1, MXFP4_BLOCK).astype(np.float64)
    exponent = np.floor(np.log2(np.maximum(np.abs(groups).max(axis=-1), 2.0**-100))) - 2
    step = np.exp2(exponent)[..., None]
    codes = np.abs(groups[..., None] / step[..., None] - E2M1_VALUES).argmin(axis=-1)
    codes = codes.astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    held = (E2M1_VALUES[codes] * step).reshape(weight.shape).astype(np.float32)
    # NOTE: contiguous: safetensors writes an array's memory as it lies.
    scales = np.ascontiguousarray((exponent + 127).astype(np.uint8))
    return np.ascontiguousarray(blocks), scales, held


def _write_released(
    hf_dir: Path,
    packed_dir: Path,
    floats: dict[str, Any],
    packed: dict[str, Any],
    quantization: dict[str, Any],
    save: Callable[..., None],
) -> None:
    """Writes a model twice: in `hf_dir` as the floats its packed weights hold, in
    `packed_dir` (a copy of `hf_dir`) as released, its ``quantization_config`` saying how."""
    save(floats, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    save(packed, str(packed_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((packed_dir / "config.json").read_text())
    config["quantization_config"] = quantization
    (packed_dir / "config.json").write_text(json.dumps(config))


def pack_mxfp4(hf_dir: Path, mxfp4_dir: Path) -> None:
    """A saved gpt-oss as released: `mxfp4_dir` a copy of `hf_dir` with the experts packed as
    the released checkpoints are (``*_blocks``, ``*_scales`` and an ``mxfp4``
    quantization_config); `hf_dir`'s experts become the floats the packed ones hold, so the
    two checkpoints are one model."""
    shutil.copytree(hf_dir, mxfp4_dir)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    packed = dict(tensors)
    for name in [n for n in tensors if n.endswith(MXFP4_EXPERTS)]:
        # transformers: [experts, in, out]; MXFP4 blocks run along in: [experts, out, in / 32]
        blocks, scales, held = mxfp4(tensors[name].transpose(0, 2, 1))
        tensors[name] = np.ascontiguousarray(held.transpose(0, 2, 1))
        del packed[name]
        packed |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
    _write_released(hf_dir, mxfp4_dir, tensors, packed, {"quant_method": "mxfp4"}, save_file)


FP8_MAX = 448.0  # the largest float8 e4m3 value


def _over_blocks(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Block scales spread over the weight of `shape` they scale."""
    rows, cols = shape[-2:]
    spread = scale.repeat_interleave(block[0], -2)[..., :rows, :]
    return spread.repeat_interleave(block[1], -1)[..., :cols]


def _fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (``[..., rows, cols]``) in block FP8: the e4m3 values and the float32 scales of
    ``block`` rows by columns (each block's largest value at 448)."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(*weight.shape[:-2], grid[0] * block[0], grid[1] * block[1])
    padded[..., :rows, :cols] = weight
    blocks = padded.unflatten(-1, (grid[1], block[1])).unflatten(-3, (grid[0], block[0]))
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)  # [..., grid rows, grid cols]
    scale = (amax / FP8_MAX).to(torch.float32)
    values = (weight / _over_blocks(scale, block, weight.shape)).to(torch.float8_e4m3fn)
    return values, scale


def pack_fp8(hf_dir: Path, fp8_dir: Path, block: tuple[int, int]) -> None:
    """A saved model as block-FP8 checkpoints are released (DeepSeek-V3's form): `fp8_dir` a
    copy of `hf_dir` whose projections are float8 e4m3 with ``<name>_scale_inv`` block scales
    and an ``fp8`` quantization_config; `hf_dir`'s projections become the floats the FP8 ones
    hold (each value times its scale, in float32), so the two checkpoints are one model."""
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    shutil.copytree(hf_dir, fp8_dir)
    tensors = load_torch(str(hf_dir / "model.safetensors"))
    packed = dict(tensors)
    for name, weight in tensors.items():
        is_projection = name.endswith(("proj.weight", "proj_with_mqa.weight"))
        if not (is_projection or name.endswith(MXFP4_EXPERTS)):
            continue
        values, scale = _fp8(weight.float(), block)
        tensors[name] = (values.float() * _over_blocks(scale, block, weight.shape)).contiguous()
        packed |= {name: values.contiguous(), f"{name}_scale_inv": scale.contiguous()}
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(block)}  # fmt: skip
    _write_released(hf_dir, fp8_dir, tensors, packed, quantization, save_torch)


def pack_fp8_channels(hf_dir: Path, fp8_dir: Path) -> None:
    """A saved model as compressed-tensors writes FP8 checkpoints: `fp8_dir` a copy of `hf_dir`
    whose 2-D projections are float8 e4m3 with a float32 ``<name>_scale`` per output row, an
    ``input_scale`` beside each (a static scheme's) and a ``compressed-tensors``
    ``float-quantized`` quantization_config; `hf_dir`'s projections become the floats the FP8
    ones hold."""
    from safetensors.torch import load_file as load_torch
    from safetensors.torch import save_file as save_torch

    shutil.copytree(hf_dir, fp8_dir)
    tensors = load_torch(str(hf_dir / "model.safetensors"))
    packed = dict(tensors)
    for name, weight in tensors.items():
        if not name.endswith("proj.weight") or weight.dim() != 2:
            continue
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        values = (weight.float() / scale).to(torch.float8_e4m3fn)
        tensors[name] = (values.float() * scale).contiguous()
        prefix = name.removesuffix(".weight")
        packed |= {
            name: values.contiguous(),
            f"{name}_scale": scale.contiguous(),
            f"{prefix}.input_scale": torch.ones(1),
        }
    quantization = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"type": "float"}}},
        "ignore": ["lm_head"],
    }
    _write_released(hf_dir, fp8_dir, tensors, packed, quantization, save_torch)
