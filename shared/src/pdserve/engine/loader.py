"""Builds the model from a Hugging Face directory (``config.json`` + ``*.safetensors``)."""

from __future__ import annotations

import json
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from torch import nn

import pdserve.engine.int4_kernel as int4_kernel
from pdserve.common.memory import return_freed_memory
from pdserve.engine.checkpoint_names import (
    EXPERT_NAME,
    QK_NAME,
    SHARD_NAME,
    STACKED,
    STACKED_EXPERTS,
    mla_rope_pairs_to_halves,
    rope_pairs_to_halves,
)
from pdserve.engine.families import Family, family_of
from pdserve.engine.gguf_int4 import INT4_FILE
from pdserve.engine.int4_weights import KeptWeights, attach_int4
from pdserve.engine.kernel_image import map_buffers
from pdserve.engine.model import LlamaForCausalLM, can_pack_for_onednn
from pdserve.engine.model_config import ModelConfig, ModelLoadError
from pdserve.engine.moe import KeptExperts, SparseMoeBlock
from pdserve.engine.packed_weights import (
    DEFAULT_FP8_BLOCK,
    Mxfp4Codes,
    PackedPairs,
    check_quantization,
)
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.parallel.sharding import shard_tensor
from pdserve.engine.quant import quantize_linears, weight_bytes

log = structlog.get_logger(__name__)

KERNEL_IMAGE_DIR = "pdserve-kernels"
"""The directory, in a released checkpoint's, of the image its kept MXFP4 experts map
(`pdserve.engine.kernel_image`)."""


def _qkv_sizes(config: ModelConfig, group: TensorParallelGroup) -> list[int]:
    shard = group.shard
    kv = len(shard.kv_head_range(config.num_key_value_heads)) * config.head_dim
    heads = shard.q_head_range(config.num_attention_heads, config.num_key_value_heads)
    return [len(heads) * config.head_dim, kv, kv]


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Gives every parameter and buffer of a meta-device `model` uninitialized storage on
    `device`, as ``Module.to_empty`` does; ``torch.empty`` rather than ``empty_like``, whose
    meta path runs through torch's Python reference ops (~0.4 s of every instance's start)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = nn.Parameter(empty, param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention_backend: str = "sdpa",
    config: ModelConfig | None = None,
    linear_backend: str = "auto",
    group: TensorParallelGroup | None = None,
    quantization: str = "auto",
) -> LlamaForCausalLM:
    """Loads a checkpoint of any family (`pdserve.engine.families`).

    Tensors are read one at a time from the (possibly sharded) safetensors files straight into
    the model's parameters, so the weights are never held twice.

    Args:
        model_dir: Directory with ``config.json`` and one or more ``*.safetensors`` files.
        dtype: Weight dtype.
        device: Target device.
        attention_backend: ``sdpa`` or ``flash``.
        config: The parsed config, if the caller already has it.
        linear_backend: ``auto`` (oneDNN-packed projections where `can_pack_for_onednn`,
            else torch's GEMM), ``onednn`` or ``torch``.
        group: This rank's tensor-parallel group: only the rank's share of each tensor is
            kept (`pdserve.engine.parallel.sharding`); a group of one when None.
        quantization: ``auto`` keeps the checkpoint's int4 weights (a GGUF's Q4_0, Q4_1 and
            Q4_K tensors, `pdserve.engine.gguf_int4`) as they are where an int4 kernel runs them
            (bfloat16 on a CPU, or float32 where pdserve's float32 kernels run; one rank), and
            a Q8_0 LM head (with the embedding tied to it) where pdserve's int8 kernel runs,
            and an MXFP4 checkpoint's experts (gpt-oss as released) as their codes on the int4
            kernel (or int8 groups where it does not take them), each value the checkpoint's
            (`pdserve.engine.moe.KeptExperts`), where pdserve's kernels run them (one rank on
            a CPU), and dequantizes them elsewhere;
            ``none`` dequantizes every weight to `dtype`; ``int8`` / ``int4`` quantize every
            projection but the LM head from the float weights (CPU; `pdserve.engine.quant`).

    Returns:
        The model in eval mode with every parameter loaded.

    Raises:
        ModelLoadError: If files are missing, a tensor has the wrong shape, or a parameter is
            absent.
    """
    path = Path(model_dir)
    config = config or ModelConfig.from_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {str(path)!r}")
    fp8_block, quant_method = _packed_form(path)
    device = torch.device(device)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attention_backend, group).to(dtype)
    mxfp4_experts: dict[str, KeptExperts] = {}
    if quant_method == "mxfp4" and quantization == "auto" and device.type == "cpu":
        mxfp4_experts = _keep_mxfp4_experts(model, dtype)
    kept = KeptWeights(frozenset(), {})
    if (path / INT4_FILE).is_file():
        # NOTE: torch's int4 kernel is fast with bf16 activations only (float32: 16-40x
        # slower than a float32 GEMM): float32 keeps the file's weights where pdserve's float32
        # kernels run (AVX2). An int4 projection has no row-parallel form yet.
        is_kept = (
            quantization == "auto"
            and device.type == "cpu"
            and (
                dtype == torch.bfloat16
                or (dtype == torch.float32 and int4_kernel.why_not(dtype) is None)
            )
            and model.group.world_size == 1
        )
        kept = attach_int4(model, path / INT4_FILE, dtype, is_kept)
    _materialize(model, device)
    params = dict(model.named_parameters())
    pending = {name: _expected_shards(name, params[name]) for name in params}
    family = family_of(config.model_type)
    if config.tie_word_embeddings:
        pending.pop("lm_head.weight_t", None)
    for name in mxfp4_experts:
        pending[name] = {0}
    packed = PackedPairs(dtype, fp8_block, lambda name: family.renamed(name) in mxfp4_experts)
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for hf_name in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                if hf_name in kept.hf_names:
                    continue
                joined = packed.join(hf_name, reader.get_tensor(hf_name))
                if joined is not None and isinstance(joined[1], Mxfp4Codes):
                    _load_mxfp4_experts(
                        family, joined[0], joined[1], mxfp4_experts, model.config, dtype
                    )
                    pending[family.renamed(joined[0])].clear()
                elif joined is not None:
                    _load_tensor(family, joined[0], joined[1], params, pending, model)
                del joined  # NOTE: before the next one is read: one tensor in flight
    packed.check_done()
    if mxfp4_experts:
        # NOTE: the experts repacked for the kernel, mapped from one image that every engine
        # loading this checkpoint shares (in a directory of its own: not a checkpoint shard).
        experts_by_module: dict[str, nn.Module] = {
            n.rpartition(".")[0]: e for n, e in mxfp4_experts.items()
        }
        map_buffers(experts_by_module, path / KERNEL_IMAGE_DIR / "mxfp4-experts")
    missing = sorted(name for name, shards in pending.items() if shards)
    if missing:
        raise ModelLoadError(f"checkpoint {str(path)!r} lacks parameters: {missing[:8]}")
    model.tie_weights()
    model.init_rotary(device)
    model.eval()
    # NOTE: weights kept quantized are buffers (int8 values; 4-bit ones two to a uint8)
    num_params = sum(p.numel() for p in model.parameters()) + sum(
        buffer.numel() * (2 if buffer.dtype == torch.uint8 else 1)
        for buffer in model.buffers()
        if buffer.dtype in (torch.int8, torch.uint8)
    )
    is_packed = linear_backend != "torch" and can_pack_for_onednn(device, dtype)
    if linear_backend == "onednn" and not is_packed:
        raise ValueError(
            f"linear_backend=onednn needs float32 or bfloat16 on a CPU, not {dtype} on {device}"
        )
    num_quantized = 0
    if quantization in ("int8", "int4"):
        if device.type != "cpu":
            raise ValueError(f"quantization={quantization} runs on CPU only, not on {device}")
        num_quantized = quantize_linears(model, quantization, skip=[model.lm_head]).num_quantized
    if is_packed:
        # NOTE: quantized projections are no longer `Linear`s; what is left (the LM head) packs.
        model.pack_linears_for_onednn()
    if device.type == "cpu":
        return_freed_memory()
    log.info(
        "model_loaded",
        model_type=config.model_type,
        num_layers=config.num_hidden_layers,
        num_params=num_params,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        linear_backend="onednn" if is_packed else "torch",
        tensor_parallel_rank=model.group.rank,
        tensor_parallel_size=model.group.world_size,
        quantization=quantization,
        num_quantized=num_quantized,
        tensor_types=_with_mxfp4_experts(kept.tensor_types, mxfp4_experts) or None,
        packed_weights=packed.num_joined or None,
        weight_bytes=weight_bytes(model),
    )
    return model


def _packed_form(path: Path) -> tuple[tuple[int, int], str | None]:
    """The block of an FP8 checkpoint's weight scales and the checkpoint's quantization method
    (``quantization_config``); a checkpoint quantized in a form the loader does not read is
    refused (`check_quantization`)."""
    config = json.loads((path / "config.json").read_text())
    check_quantization(config)
    quantization = config.get("quantization_config") or {}
    method = quantization.get("quant_method")
    block = quantization.get("weight_block_size")
    if not block:
        return DEFAULT_FP8_BLOCK, method
    rows, cols = (int(size) for size in block)
    return (rows, cols), method


def _keep_mxfp4_experts(model: LlamaForCausalLM, dtype: torch.dtype) -> dict[str, KeptExperts]:
    """Puts `KeptExperts` in place of a meta-device model's experts where pdserve's kernels
    run them (one rank), and says in one line what they became: their MXFP4 codes on the int4
    kernel, or int8 groups (`KeptExperts.mxfp4_form`).

    Returns:
        Each stacked projection's checkpoint name (``...mlp.experts.gate_up_proj``) -> the
        experts that take it.
    """
    config = model.config
    assert config.moe is not None
    why_not = KeptExperts.why_not(config.moe, config.hidden_size, dtype)
    if why_not is None and model.group.world_size > 1:
        why_not = "tensor-parallel ranks split the experts (no int8 form of that yet)"
    kept: dict[str, KeptExperts] = {}
    if why_not is None:
        for name, block in model.named_modules():
            if isinstance(block, SparseMoeBlock):
                experts = KeptExperts.placeholder(config, dtype)
                block.experts = experts
                for part in KeptExperts.PARTS:
                    kept[f"{name}.experts.{part}"] = experts
    form = KeptExperts.mxfp4_form(config.hidden_size, config.moe.moe_intermediate_size, dtype)
    log.info(
        "mxfp4_experts",
        became=f"{form} (pdserve's kernel)" if kept else str(dtype).removeprefix("torch."),
        num_layers=len(kept) // len(KeptExperts.PARTS),
        why_not=why_not,
    )
    return kept


def _with_mxfp4_experts(
    tensor_types: dict[str, str], mxfp4_experts: dict[str, KeptExperts]
) -> dict[str, str]:
    """A GGUF's tensor types and what each became, its MXFP4 tensors (gpt-oss's experts, read
    as the released checkpoint's: `pdserve.engine.gguf_import.mxfp4_tensors`) by the form the
    experts took where they were kept."""
    if "MXFP4" not in tensor_types or not mxfp4_experts:
        return tensor_types
    forms = sorted({form for experts in mxfp4_experts.values() for form in experts.forms.values()})
    return {**tensor_types, "MXFP4": ", ".join(forms)}


def _load_mxfp4_experts(
    family: Family,
    checkpoint_name: str,
    weight: Mxfp4Codes,
    mxfp4_experts: dict[str, KeptExperts],
    config: ModelConfig,
    dtype: torch.dtype,
) -> None:
    """One stacked projection of MXFP4 experts into its `KeptExperts`, reordered as the family
    reorders the same weight in floats: its ``[experts, out, in]`` codes and ``[experts, out,
    in / 32]`` scales go through the family's `Family.load_tensor` as the dequantized stack
    would (``[experts, in, out]``, transformers' layout) and come out ``[experts, out, in]``."""
    hf_name = family.renamed(checkpoint_name)
    values, scales = weight.codes.transpose(1, 2), weight.scales.transpose(1, 2)
    if family.load_tensor is not None:
        reordered_values = family.load_tensor(hf_name, values, config)
        reordered_scales = family.load_tensor(hf_name, scales, config)
        if reordered_values is None or reordered_scales is None:
            raise ModelLoadError(f"the {family.model_type} family leaves out {hf_name!r}")
        values, scales = reordered_values, reordered_scales
    part = hf_name.rpartition(".")[2]
    mxfp4_experts[hf_name].load_mxfp4(part, Mxfp4Codes(values.contiguous(), scales), dtype)


def _expected_shards(name: str, param: torch.Tensor) -> set[int]:
    if name.endswith(".experts.gate_up_proj"):
        return set(range(2 * param.shape[0]))
    if name.endswith(".experts.down_proj"):
        return set(range(param.shape[0]))
    if ".qkv_proj." in name:
        return {0, 1, 2}
    if ".gate_up_proj." in name:
        return {0, 1}
    return {0}


def _load_tensor(
    family: Family,
    checkpoint_name: str,
    tensor: torch.Tensor,
    params: dict[str, torch.nn.Parameter],
    pending: dict[str, set[int]],
    model: LlamaForCausalLM,
) -> None:
    config = model.config
    hf_name = family.renamed(checkpoint_name)
    if hf_name.endswith("rotary_emb.inv_freq"):
        return
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return
    if family.load_tensor is not None:
        tensor = family.load_tensor(hf_name, tensor, config)
        if tensor is None:
            return
    if config.mla is not None and config.mla.is_rope_interleaved:
        tensor = mla_rope_pairs_to_halves(hf_name, tensor, config.mla)
    if hf_name.endswith(".mlp.score_correction"):
        tensor = tensor.reshape(1, -1)  # NOTE: GLM-4.5 stores it [experts], ERNIE [1, experts]
    if config.is_rope_interleaved and QK_NAME.search(hf_name):
        tensor = rope_pairs_to_halves(tensor, config.head_dim, config.rotary_dim)
    tensor = shard_tensor(hf_name, tensor, config, model.group.shard)
    if _load_expert(hf_name, tensor, params, pending):
        return
    match = SHARD_NAME.search(hf_name)
    if match is not None and config.mla is not None and match.group(1) == "q_proj":
        match = None  # NOTE: latent attention's q_proj stands alone (no k/v to stack with)
    if match is None:
        name, shard, offset = hf_name, 0, 0
    else:
        fused, shard = STACKED[match.group(1)]
        name = hf_name.replace(f".{match.group(1)}.", f".{fused}.")
    transposed = name.endswith(".weight") and f"{name}_t" in params
    if transposed:
        # NOTE: our projections store weights as [in, out]; HF stores [out, in].
        name, tensor = f"{name}_t", tensor.t()
    if name not in params:
        raise ModelLoadError(f"unexpected tensor {hf_name!r} in checkpoint")
    target = params[name].data
    if match is not None:
        dim = 1 if transposed else 0
        if fused == "qkv_proj":
            offset = sum(_qkv_sizes(config, model.group)[:shard])
        else:
            # NOTE: gate then up, each half of the fused projection (shared experts included).
            offset = shard * target.shape[dim] // 2
        target = target.narrow(dim, offset, tensor.shape[dim])
    _copy(hf_name, target, tensor)
    if match is None:
        # NOTE: a checkpoint that stores the projection fused (Phi-3) fills it in one tensor.
        pending[name].clear()
    else:
        pending[name].discard(shard)


def _load_expert(
    hf_name: str,
    tensor: torch.Tensor,
    params: dict[str, torch.nn.Parameter],
    pending: dict[str, set[int]],
) -> bool:
    """Copies one expert's projection (or all experts' at once) into the stacked tensors."""
    stacked = STACKED_EXPERTS.match(hf_name)
    if stacked is not None and hf_name in params:
        # [experts, out, in] -> [experts, in, out]
        _copy(hf_name, params[hf_name].data, tensor.transpose(1, 2))
        pending[hf_name].clear()
        return True
    match = EXPERT_NAME.match(hf_name)
    if match is None:
        return False
    prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
    name = f"{prefix}.down_proj" if part == "down_proj" else f"{prefix}.gate_up_proj"
    if name not in params:
        raise ModelLoadError(f"unexpected tensor {hf_name!r} in checkpoint")
    # target: [in, out] of this expert
    target = params[name].data[expert]
    shard = expert
    if part != "down_proj":
        half = target.shape[1] // 2
        shard = 2 * expert + (part == "up_proj")
        target = target.narrow(1, half if part == "up_proj" else 0, half)
    _copy(hf_name, target, tensor.t())
    pending[name].discard(shard)
    return True


def _copy(hf_name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    if target.shape != tensor.shape:
        raise ModelLoadError(
            f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
        )
    with torch.no_grad():
        target.copy_(tensor)
