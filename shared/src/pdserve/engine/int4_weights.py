"""A GGUF's int4 weights (`pdserve.engine.gguf_int4`) put into the model as `Int4Linear`
projections, and a Q8_0 LM head (with the embedding it is tied to) as `Int8GroupLinear`, before
the loader fills the rest from the float checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import structlog
import torch
from safetensors import safe_open

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
from pdserve.engine.linear import Linear
from pdserve.engine.model import LlamaForCausalLM
from pdserve.engine.model_config import ModelLoadError
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
    over those values.

    A fused projection is replaced only when all its parts (q, k and v; gate and up) are kept,
    and only where torch's int4 kernel takes its shape; the others stay `Linear`s that the
    loader fills from the float checkpoint. A Q8_0 LM head becomes an `Int8GroupLinear` (and a
    Q8_0 embedding an `Int8GroupEmbedding`, over the head's tensors when tied) where pdserve's
    int8 kernel runs (`attach_int8`).

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
        int4_type_names = {t.name for t in INT4_TYPES}
        for hf_name in types if is_kept else ():
            if types[hf_name] not in int4_type_names:
                continue
            target = _int4_target(hf_name, model)
            if target is not None:
                module_name, shard, num_shards = target
                shards.setdefault(module_name, {})[shard] = hf_name
                expected[module_name] = num_shards
        attached: set[str] = set()
        kernels: dict[str, int] = {}
        for module_name, by_shard in shards.items():
            linear = model.get_submodule(module_name)
            assert isinstance(linear, Linear)
            in_features, out_features = linear.weight_t.shape
            names = [by_shard[i] for i in sorted(by_shard)]
            if len(names) != expected[module_name] or not can_quantize_int4(
                in_features, out_features, INT4_GROUP_SIZE
            ):
                continue
            # values: [out, in / 2] uint8; scales, mins: [out, in / group], shards stacked
            values, scales, mins = (
                torch.cat([reader.get_tensor(name + suffix) for name in names])
                for suffix in (VALUES, SCALES, MINS)
            )
            if tuple(values.shape) != (out_features, in_features // 2):
                raise ModelLoadError(
                    f"int4 weight {module_name!r} has shape {tuple(values.shape)}, expected "
                    f"{(out_features, in_features // 2)}"
                )
            parent_name, _, child = module_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            kept = Int4Linear.from_blocks(values, scales, mins, linear.bias, dtype)
            setattr(parent, child, kept)
            attached.update(names)
            kernels[kept.kernel] = kernels.get(kept.kernel, 0) + 1
        lm_head = attach_int8(model, reader, types, dtype, attached) if is_kept else None
    if kernels or lm_head is not None:
        # NOTE: one line per load says which int4 kernel runs and, for torch's, why, and what
        # a quantized LM head became.
        log.info(
            "int4_kernel",
            projections=kernels,
            why_not_pdserve=None if "torch" not in kernels else int4_kernel.why_not(dtype),
            lm_head=lm_head,
        )
    return KeptWeights(frozenset(attached), _tensor_types(types, counts, attached, dtype))


def attach_int8(
    model: LlamaForCausalLM,
    reader: Any,
    types: dict[str, str],
    dtype: torch.dtype,
    attached: set[str],
) -> str | None:
    """Replaces a Q8_0 LM head by an `Int8GroupLinear` over the file's values and scales, and a
    Q8_0 embedding by an `Int8GroupEmbedding` (the head's own tensors when they are tied),
    where pdserve's int8 kernel runs; adds the names it kept to `attached`.

    Args:
        model: The model on the meta device.
        reader: The open `INT4_FILE`.
        types: Each kept weight's GGUF type.
        dtype: The activation dtype.
        attached: The names kept so far.

    Returns:
        What the LM head became, for the start-up line (None where the file's is not Q8_0).
    """
    int8_type_names = {t.name for t in INT8_TYPES}
    embedding_name = "model.embed_tokens.weight"
    head_name = embedding_name if model.config.tie_word_embeddings else "lm_head.weight"
    head_type = types.get(head_name)
    if head_type not in int8_type_names:
        return None
    why_not = int8_kernel.why_not(dtype, model.config.hidden_size)
    if why_not is not None:
        return f"{str(dtype).removeprefix('torch.')} ({head_type} dequantized: {why_not})"
    num_rows = model.config.vocab_size
    kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in {head_name, embedding_name}:
        if types.get(name) not in int8_type_names:
            continue
        values, scales = reader.get_tensor(name + INT8), reader.get_tensor(name + SCALES)
        expected = (num_rows, model.config.hidden_size)
        if tuple(values.shape) != expected:
            raise ModelLoadError(
                f"int8 weight {name!r} has shape {tuple(values.shape)}, expected {expected}"
            )
        kept[name] = values, scales
    head = Int8GroupLinear(*kept[head_name], dtype)
    model.lm_head = head  # type: ignore[assignment]
    if embedding_name in kept:
        embedding = (
            Int8GroupEmbedding.tied_to(head, dtype)
            if model.config.tie_word_embeddings
            else Int8GroupEmbedding(*kept[embedding_name], dtype)
        )
        setattr(model.model, "embed_tokens", embedding)  # noqa: B010 (nn.Module's typed __setattr__)
    attached.update(kept)
    return f"int8 ({head_type}, {head.kernel}'s kernel)"


def _tensor_types(
    types: dict[str, str], counts: dict[str, int], attached: set[str], dtype: torch.dtype
) -> dict[str, str]:
    """Each GGUF tensor type -> what its tensors became: ``int4``, the dtype, or both."""
    dtype_name = str(dtype).removeprefix("torch.")
    int8_type_names = {t.name for t in INT8_TYPES}
    became = {}
    for type_name in sorted(counts):
        num_kept = sum(1 for name in attached if types[name] == type_name)
        kept_as = "int8" if type_name in int8_type_names else "int4"
        num_of_type = sum(1 for t in types.values() if t == type_name)
        if type_name in int8_type_names or not num_of_type:
            # NOTE: of a Q8_0 file's tensors only the embedding and LM head are in the file.
            num_of_type = max(num_of_type, counts[type_name])
        if num_kept == 0:
            became[type_name] = dtype_name
        elif num_kept == num_of_type:
            became[type_name] = kept_as
        else:
            became[type_name] = f"{kept_as} ({num_kept} of {num_of_type}), else {dtype_name}"
    return became
