"""Builds the model from a Hugging Face directory (``config.json`` + ``*.safetensors``)."""

from __future__ import annotations

import re
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from pdserve.engine.model import LlamaForCausalLM, can_pack_for_onednn
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.quant import quantize_linears, weight_bytes

log = structlog.get_logger(__name__)

# NOTE: HF keeps q/k/v and gate/up as separate matrices; we stack them into one projection.
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_SHARD_NAME = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


def _shard_sizes(config: ModelConfig, fused: str) -> list[int]:
    if fused == "qkv_proj":
        kv = config.num_key_value_heads * config.head_dim
        return [config.num_attention_heads * config.head_dim, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention_backend: str = "sdpa",
    config: ModelConfig | None = None,
    linear_backend: str = "auto",
    quantization: str = "none",
) -> LlamaForCausalLM:
    """Loads a Llama/Qwen2/Mistral checkpoint.

    Args:
        model_dir: Directory with ``config.json`` and one or more ``*.safetensors`` files.
        dtype: Weight dtype.
        device: Target device.
        attention_backend: ``sdpa`` or ``flash``.
        config: The parsed config, if the caller already has it.
        linear_backend: ``auto`` (oneDNN-packed projections where `can_pack_for_onednn`,
            else torch's GEMM), ``onednn`` or ``torch``.
        quantization: ``none``, or ``int8`` / ``int4`` weight-only quantization of every
            projection but the LM head (CPU; `pdserve.engine.quant`).

    Returns:
        The model in eval mode with every parameter loaded.

    Raises:
        ValueError: If files are missing, a tensor has the wrong shape, or a parameter is absent.
    """
    path = Path(model_dir)
    config = config or ModelConfig.from_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(path)!r}")
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention_backend).to(dtype)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    pending = {name: _expected_shards(name, config) for name in params}
    if config.tie_word_embeddings:
        pending.pop("lm_head.weight_t")
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for hf_name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                _load_tensor(hf_name, reader.get_tensor(hf_name), params, pending, config)
    missing = sorted(name for name, shards in pending.items() if shards)
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks parameters: {missing[:8]}")
    model.tie_weights()
    model.init_rotary(device)
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    is_packed = linear_backend != "torch" and can_pack_for_onednn(device, dtype)
    if linear_backend == "onednn" and not is_packed:
        raise ValueError(
            f"linear_backend=onednn needs float32 or bfloat16 on a CPU, not {dtype} on {device}"
        )
    num_quantized = 0
    if quantization != "none":
        if device.type != "cpu":
            raise ValueError(f"quantization={quantization} runs on CPU only, not on {device}")
        num_quantized = quantize_linears(model, quantization, skip=[model.lm_head]).num_quantized
    if is_packed:
        # NOTE: quantized projections are no longer `Linear`s; what is left (the LM head) packs.
        model.pack_linears_for_onednn()
    log.info(
        "model_loaded",
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_params=num_params,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        linear_backend="onednn" if is_packed else "torch",
        quantization=quantization,
        num_quantized=num_quantized,
        weight_bytes=weight_bytes(model),
    )
    return model


def _expected_shards(name: str, config: ModelConfig) -> set[int]:
    for fused in ("qkv_proj", "gate_up_proj"):
        if f".{fused}." in name:
            return set(range(len(_shard_sizes(config, fused))))
    return {0}


def _load_tensor(
    hf_name: str,
    tensor: torch.Tensor,
    params: dict[str, torch.nn.Parameter],
    pending: dict[str, set[int]],
    config: ModelConfig,
) -> None:
    if hf_name.endswith("rotary_emb.inv_freq"):
        return
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return
    match = _SHARD_NAME.search(hf_name)
    if match is None:
        name, shard, offset = hf_name, 0, 0
    else:
        fused, shard = _STACKED[match.group(1)]
        name = hf_name.replace(f".{match.group(1)}.", f".{fused}.")
        offset = sum(_shard_sizes(config, fused)[:shard])
    transposed = name.endswith(".weight") and f"{name}_t" in params
    if transposed:
        # NOTE: our projections store weights as [in, out]; HF stores [out, in].
        name, tensor = f"{name}_t", tensor.t()
    if name not in params:
        raise ValueError(f"unexpected tensor {hf_name!r} in checkpoint")
    target = params[name].data
    if match is not None:
        target = target.narrow(1 if transposed else 0, offset, tensor.shape[1 if transposed else 0])
    if target.shape != tensor.shape:
        raise ValueError(
            f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)
    pending[name].discard(shard)
