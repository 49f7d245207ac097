"""A GGUF's int4 weights (`pdserve.engine.gguf_int4`) put into the model as `Int4Linear`
projections, its int8 ones (Q8_0, Q6_K, Q5_K) as `Int8GroupLinear` projections and LM head (with
the embedding it is tied to), before the loader fills the rest from the float checkpoint."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import structlog
import torch
from safetensors import safe_open
from torch import nn

import pdserve.engine.int4_kernel as int4_kernel
import pdserve.engine.int8_kernel as int8_kernel
from pdserve.engine.checkpoint_names import EXPERT_NAME, SHARD_NAME, STACKED, renamed
from pdserve.engine.gguf_int4 import (
    COUNTS_KEY,
    INT4_TYPES,
    INT8,
    INT8_TYPES,
    MINS,
    SCALES,
    TYPES_KEY,
    VALUES,
)
from pdserve.engine.kernel_image import map_buffers
from pdserve.engine.linear import Linear
from pdserve.engine.model import LlamaForCausalLM
from pdserve.engine.model_config import ModelLoadError
from pdserve.engine.moe import KeptExperts, SparseMoeBlock
from pdserve.engine.quant import (
    INT4_GROUP_SIZE,
    Int4Linear,
    Int8GroupEmbedding,
    Int8GroupLinear,
    can_quantize_int4,
)

log = structlog.get_logger(__name__)


class KeptWeights(NamedTuple):
    """What `attach_int4` kept as the checkpoint stores it.

    Attributes:
        hf_names: Weights now held by `Int4Linear` projections or the int8 LM head and
            embedding (the loader skips their floats).
        tensor_types: The GGUF's tensor types and what each became (``int4``, ``int8`` or a
            dtype).
    """

    hf_names: frozenset[str]
    tensor_types: dict[str, str]


def _int4_target(hf_name: str, model: LlamaForCausalLM) -> tuple[str, int, int] | None:
    """(projection module name, shard, number of shards) the weight fills, or None where it
    is no `Linear` of this model (an embedding, an expert, a tied LM head)."""
    name = renamed(hf_name)
    if not name.endswith(".weight") or EXPERT_NAME.match(name):
        return None
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return None
    match = SHARD_NAME.search(name)
    shard, num_shards = 0, 1
    if match is not None:
        fused, shard = STACKED[match.group(1)]
        num_shards = 3 if fused == "qkv_proj" else 2
        name = name.replace(f".{match.group(1)}.", f".{fused}.")
    module_name = name.removesuffix(".weight")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return (module_name, shard, num_shards) if isinstance(module, Linear) else None


def attach_int4(
    model: LlamaForCausalLM, int4_file: Path, dtype: torch.dtype, is_kept: bool
) -> KeptWeights:
    """Replaces every projection whose weights the checkpoint keeps as int4 by an `Int4Linear`
    over those values, and every one it keeps as int8 (Q8_0, Q6_K, Q5_K; or a fused one of
    mixed types) by an `Int8GroupLinear`.

    A fused projection is replaced only when all its parts (q, k and v; gate and up) are kept:
    as int4 where every part is int4 and torch's int4 kernel takes its shape, as int8 (every
    part's values exactly, `int8_parts`) where a part is int8 and pdserve's int8 kernel runs;
    the others stay `Linear`s that the loader fills from the float checkpoint. An int8 LM head
    becomes an `Int8GroupLinear` (and an int8 embedding an `Int8GroupEmbedding`, over the
    head's tensors when tied) where pdserve's int8 kernel runs (`attach_int8`).

    Args:
        model: The model on the meta device, before its parameters are materialized.
        int4_file: The directory's `pdserve.engine.gguf_int4.INT4_FILE`.
        dtype: The activation dtype.
        is_kept: Whether to replace anything; when false only reports that every tensor
            type becomes `dtype`.
    """
    with safe_open(str(int4_file), framework="pt") as reader:
        metadata = reader.metadata() or {}
        types: dict[str, str] = json.loads(metadata.get(TYPES_KEY, "{}"))
        counts: dict[str, int] = json.loads(metadata.get(COUNTS_KEY, "{}"))
        shards: dict[str, dict[int, str]] = {}
        expected: dict[str, int] = {}
        attached: dict[str, str] = {}
        kept_file = _KeptFile(reader, types, dtype, attached)
        for hf_name in types if is_kept else ():
            if types[hf_name] not in _INT4_TYPE_NAMES | _INT8_TYPE_NAMES:
                continue
            target = _int4_target(hf_name, model)
            if target is not None:
                module_name, shard, num_shards = target
                shards.setdefault(module_name, {})[shard] = hf_name
                expected[module_name] = num_shards
        built: dict[str, nn.Module] = {}
        kernels: dict[str, int] = {}
        int8_why_not: str | None = None
        for module_name, by_shard in shards.items():
            linear = model.get_submodule(module_name)
            assert isinstance(linear, Linear)
            in_features, out_features = linear.weight_t.shape
            names = [by_shard[i] for i in sorted(by_shard)]
            if len(names) != expected[module_name]:
                continue
            kept: Int4Linear | Int8GroupLinear
            if all(types[name] in _INT4_TYPE_NAMES for name in names):
                if not can_quantize_int4(in_features, out_features, INT4_GROUP_SIZE) or (
                    dtype != torch.bfloat16 and not int4_kernel.takes(in_features, dtype)
                ):
                    # NOTE: torch's int4 kernel runs bf16 only at speed; elsewhere a shape
                    # pdserve's kernel refuses is dequantized.
                    continue
                # values: [out, in / 2] uint8; scales, mins: [out, in / group], shards stacked
                values, scales, mins = (
                    torch.cat([reader.get_tensor(name + suffix) for name in names])
                    for suffix in (VALUES, SCALES, MINS)
                )
                _check_shape(module_name, values, (out_features, in_features // 2))
                kept = Int4Linear.from_blocks(values, scales, mins, linear.bias, dtype)
                kind = "int4"
            elif module_name == "lm_head":
                continue  # `attach_int8`'s, with the embedding
            else:
                int8_why_not = int8_kernel.why_not(dtype, in_features)
                if int8_why_not is not None:
                    continue
                values, scales, int8_mins = int8_parts([kept_file.int8_part(n) for n in names])
                _check_shape(module_name, values, (out_features, in_features))
                kept = Int8GroupLinear(values, scales, dtype, int8_mins, linear.bias)
                kind = "int8"
            parent_name, _, child = module_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, kept)
            built[module_name] = kept
            attached.update(dict.fromkeys(names, kind))
            key = f"{kind} ({kept.kernel}'s kernel)"
            kernels[key] = kernels.get(key, 0) + 1
        if is_kept:
            experts = attach_experts(model, kept_file)
            built |= experts
            for kept_experts in experts.values():
                # NOTE: each layer's two stacked projections, by form.
                for form in kept_experts.forms.values():
                    key = f"{form} experts (pdserve's kernel)"
                    kernels[key] = kernels.get(key, 0) + 1
    # NOTE: the projections and experts were built from copies of the file's tensors and now map
    # their image; the LM head and the embedding map the file's own, through a reader of their
    # own so that the pages read to build the others leave this process's memory with the first.
    map_buffers(built, int4_file)
    lm_head = None
    if is_kept:
        with safe_open(str(int4_file), framework="pt") as reader:
            lm_head = attach_int8(model, _KeptFile(reader, types, dtype, attached))
    if kernels or lm_head is not None:
        # NOTE: one line per load says which kernel runs each kind of projection and, for
        # torch's, why, and what a quantized LM head became.
        is_torch = any(key.startswith("int4 (torch") for key in kernels)
        log.info(
            "int4_kernel",
            activations=str(dtype).removeprefix("torch."),
            # NOTE: pdserve's kernels for bf16 activations need AVX512-BF16, for float32 AVX2.
            instructions="AVX512-BF16" if dtype == torch.bfloat16 else "AVX2, FMA, F16C",
            projections=kernels,
            why_not_pdserve=int4_kernel.why_not(dtype) if is_torch else None,
            why_not_int8=int8_why_not,
            lm_head=lm_head,
        )
    return KeptWeights(frozenset(attached), _tensor_types(types, counts, attached, dtype))


def _check_shape(module_name: str, values: torch.Tensor, expected: tuple[int, int]) -> None:
    if tuple(values.shape) != expected:
        raise ModelLoadError(
            f"quantized weight {module_name!r} has shape {tuple(values.shape)}, expected {expected}"
        )


Int8Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""An int8 weight's (values ``[out, in]`` int8, scales ``[out, in / group]``, mins or None)."""


_INT4_TYPE_NAMES = frozenset(t.name for t in INT4_TYPES)
_INT8_TYPE_NAMES = frozenset(t.name for t in INT8_TYPES)


@dataclass
class _KeptFile:
    """The open `INT4_FILE` as each attach step reads it.

    Attributes:
        reader: The file's reader.
        types: Each kept weight's GGUF type.
        dtype: The activation dtype.
        attached: The names kept so far, and what each became (the steps add theirs).
        keys: The reader's tensor names (read once, not for each of a layer's hundreds of
            experts).
    """

    reader: Any
    types: dict[str, str]
    dtype: torch.dtype
    attached: dict[str, str]
    keys: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.keys = frozenset(self.reader.keys())

    def int8_part(self, name: str) -> Int8Part:
        """One kept weight as int8 groups: an int4 one's 4-bit values widened (exact)."""
        reader = self.reader
        if self.types[name] in _INT4_TYPE_NAMES:
            # values: [out, in] int8 in 0..15
            values = int4_kernel.unpack_nibbles(reader.get_tensor(name + VALUES)).to(torch.int8)
            return values, reader.get_tensor(name + SCALES), reader.get_tensor(name + MINS)
        mins = reader.get_tensor(name + MINS) if name + MINS in self.keys else None
        return reader.get_tensor(name + INT8), reader.get_tensor(name + SCALES), mins


def int8_parts(parts: list[Int8Part]) -> Int8Part:
    """The parts of a fused projection stacked along the output rows, in one layout that holds
    each part's values exactly: their own where all share it, else groups of the smallest size
    with float32 scales (and float32 mins, zero where a part has none)."""
    groups = [values.shape[1] // scales.shape[1] for values, scales, _ in parts]
    if len(set(groups)) == 1 and len({scales.dtype for _, scales, _ in parts}) == 1:
        values = torch.cat([v for v, _, _ in parts])
        scales = torch.cat([s for _, s, _ in parts])
        if all(m is None for _, _, m in parts):
            return values, scales, None
        zeros = [torch.zeros_like(s, dtype=torch.float32) if m is None else m for _, s, m in parts]
        return values, scales, torch.cat(zeros)
    group = min(groups)
    values = torch.cat([v for v, _, _ in parts])
    scales = torch.cat(
        [
            s.float().repeat_interleave(g // group, dim=1)
            for (_, s, _), g in zip(parts, groups, strict=True)
        ]
    )
    if all(m is None for _, _, m in parts):
        return values, scales, None
    mins = torch.cat(
        [
            torch.zeros(v.shape[0], v.shape[1] // group)
            if m is None
            else m.float().repeat_interleave(g // group, dim=1)
            for (v, _, m), g in zip(parts, groups, strict=True)
        ]
    )
    return values, scales, mins


def attach_int8(model: LlamaForCausalLM, kept_file: _KeptFile) -> str | None:
    """Replaces an int8-typed LM head (Q8_0, Q6_K, Q5_K) by an `Int8GroupLinear` over the
    file's values, scales and mins, and such an embedding by an `Int8GroupEmbedding` (the
    head's own tensors when they are tied), where pdserve's int8 kernel runs; adds the names it
    kept to `kept_file.attached`.

    Returns:
        What the LM head became, for the start-up line (None where the file's is not int8).
    """
    types, dtype = kept_file.types, kept_file.dtype
    embedding_name = "model.embed_tokens.weight"
    head_name = embedding_name if model.config.tie_word_embeddings else "lm_head.weight"
    head_type = types.get(head_name)
    if head_type not in _INT8_TYPE_NAMES:
        return None
    why_not = int8_kernel.why_not(dtype, model.config.hidden_size)
    if why_not is not None:
        return f"{str(dtype).removeprefix('torch.')} ({head_type} dequantized: {why_not})"
    num_rows = model.config.vocab_size
    kept: dict[str, Int8Part] = {}
    for name in {head_name, embedding_name}:
        if types.get(name) not in _INT8_TYPE_NAMES:
            continue
        values, scales, mins = kept_file.int8_part(name)
        expected = (num_rows, model.config.hidden_size)
        if tuple(values.shape) != expected:
            raise ModelLoadError(
                f"int8 weight {name!r} has shape {tuple(values.shape)}, expected {expected}"
            )
        kept[name] = values, scales, mins
    values, scales, mins = kept[head_name]
    head = Int8GroupLinear(values, scales, dtype, mins)
    model.lm_head = head  # type: ignore[assignment]
    if embedding_name in kept:
        if model.config.tie_word_embeddings:
            embedding = Int8GroupEmbedding.tied_to(head, dtype)
        else:
            values, scales, mins = kept[embedding_name]
            embedding = Int8GroupEmbedding(values, scales, dtype, mins)
        setattr(model.model, "embed_tokens", embedding)  # noqa: B010 (nn.Module's typed __setattr__)
    kept_file.attached.update(dict.fromkeys(kept, "int8"))
    return f"int8 ({head_type}, {head.kernel}'s kernel)"


def attach_experts(model: LlamaForCausalLM, kept_file: _KeptFile) -> dict[str, KeptExperts]:
    """Replaces the routed experts of each MoE layer whose every expert the file keeps (int4 or
    int8 types) by `KeptExperts` over their values, exactly, where pdserve's int8 kernel runs;
    adds the names it kept, and what each became, to `kept_file.attached`.

    Each projection (gate and up together, down) stays int4 where every expert's is int4
    (Q4_0, Q4_1, Q4_K) and the int4 kernel takes its width (`KeptExperts.load_int4`); else it
    becomes int8 groups (`int8_parts` for gate and up; 4-bit values widened).

    Returns:
        The experts it built, by module name.
    """
    config, reader, types, dtype = model.config, kept_file.reader, kept_file.types, kept_file.dtype
    kept: dict[str, KeptExperts] = {}
    if config.moe is None or KeptExperts.why_not(config.moe, config.hidden_size, dtype):
        return kept
    # module name -> {(expert, part): checkpoint name}
    layers: dict[str, dict[tuple[int, str], str]] = {}
    for hf_name in types:
        match = EXPERT_NAME.match(renamed(hf_name))
        if match is not None:
            key = (int(match.group(2)), match.group(3))
            layers.setdefault(match.group(1).removesuffix(".experts"), {})[key] = hf_name
    num_experts = config.moe.num_experts
    sources = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
    in_features = {"gate_up_proj": config.hidden_size,
                   "down_proj": config.moe.moe_intermediate_size}  # fmt: skip
    wanted = [(e, p) for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
    for module_name, names in layers.items():
        block = model.get_submodule(module_name)
        if not isinstance(block, SparseMoeBlock) or any(key not in names for key in wanted):
            continue
        loads: list[tuple[str, str, tuple[torch.Tensor, ...]]] = []
        for part, projections in sources.items():
            part_names = [names[e, p] for e in range(num_experts) for p in projections]
            if all(types[n] in _INT4_TYPE_NAMES for n in part_names) and int4_kernel.takes(
                in_features[part], dtype
            ):
                # NOTE: an expert's gate and up rows one after the other, as for int8.
                stacks = tuple(
                    torch.stack(
                        [torch.cat([reader.get_tensor(names[e, p] + suffix) for p in projections])
                         for e in range(num_experts)]
                    )
                    for suffix in (VALUES, SCALES, MINS)
                )  # fmt: skip
                loads.append((part, "int4", stacks))
                continue
            parts = [[kept_file.int8_part(names[e, p]) for p in projections]
                     for e in range(num_experts)]  # fmt: skip
            stack = _stacked([int8_parts(expert) for expert in parts])
            if stack is None:
                break  # NOTE: experts of one stack in different layouts: dequantized
            loads.append((part, "int8", tuple(t for t in stack if t is not None)))
        else:
            experts = KeptExperts.placeholder(config, dtype)
            for part, form, tensors in loads:
                if form == "int4":
                    experts.load_int4(part, *tensors)
                else:
                    experts.load_int8(part, *tensors)
                for e in range(num_experts):
                    for p in sources[part]:
                        kept_file.attached[names[e, p]] = form
            block.experts = experts
            kept[f"{module_name}.experts"] = experts
    return kept


def _stacked(parts: list[Int8Part]) -> Int8Part | None:
    """Each expert's (values, scales, mins) stacked along a first dimension; None where they
    differ in layout (shapes, dtypes, mins or none)."""
    first_values, first_scales, first_mins = parts[0]
    for values, scales, mins in parts:
        if (
            values.shape != first_values.shape
            or scales.shape != first_scales.shape
            or scales.dtype != first_scales.dtype
            or (mins is None) != (first_mins is None)
        ):
            return None
    all_mins = [m for _, _, m in parts if m is not None]
    return (
        torch.stack([v for v, _, _ in parts]),
        torch.stack([s for _, s, _ in parts]),
        torch.stack(all_mins) if all_mins else None,
    )


def _tensor_types(
    types: dict[str, str], counts: dict[str, int], attached: dict[str, str], dtype: torch.dtype
) -> dict[str, str]:
    """Each GGUF tensor type -> what its tensors became: ``int4``, ``int8``, the dtype, or a
    mix (``int4 (3 of 5), int8 (1 of 5), else bfloat16``)."""
    dtype_name = str(dtype).removeprefix("torch.")
    became = {}
    for type_name in sorted(counts):
        kinds = Counter(kind for name, kind in attached.items() if types[name] == type_name)
        num_of_type = sum(1 for t in types.values() if t == type_name) or counts[type_name]
        num_kept = sum(kinds.values())
        if num_kept == 0:
            became[type_name] = dtype_name
        elif num_kept == num_of_type and len(kinds) == 1:
            became[type_name] = next(iter(kinds))
        else:
            parts = [f"{kind} ({kinds[kind]} of {num_of_type})" for kind in sorted(kinds)]
            if num_kept < num_of_type:
                parts.append(f"else {dtype_name}")
            became[type_name] = ", ".join(parts)
    return became
