"""GGUF's 4-bit blocks as int4 groups of 32 with a scale and a min: the file's own values.

llama.cpp's Q4_0, Q4_1 and Q4_K store each weight as a 4-bit value ``q`` (0..15) in groups of
32 along the input features, with a group's float as ``scale * q + min``:

* Q4_0: ``d * (q - 8)``, so ``scale = d``, ``min = -8 * d``;
* Q4_1: ``d * q + m``, so ``scale = d``, ``min = m``;
* Q4_K: 256-weight super-blocks of 8 groups, ``(d * sc) * q - dmin * mn`` with 6-bit ``sc``
  and ``mn`` per group, so ``scale = d * sc``, ``min = -(dmin * mn)``.

Every scale and min is exact in float32 (a float16 times at most a 6-bit integer), and
`dequantize` computes ``scale * q + min`` as the ``gguf`` package does: bit for bit the same
float32 weights. `convert_gguf` writes these tensors beside the dequantized checkpoint
(`INT4_FILE`); the loader builds `pdserve.engine.quant.Int4Linear` projections from them
(torch's int4 kernel takes ``(q - 8) * scale + zero``, so ``zero = min + 8 * scale``).
Other types (Q5_K, Q6_K, Q8_0, ...) have 5 to 8-bit values or groups of 16 that torch's int4
kernel cannot hold exactly; they stay in the dequantized checkpoint.

One exception: a Q8_0 embedding or LM head (``d * q``, an int8 ``q`` and a float16 ``d`` per
group of 32; llama.cpp's quantizers keep the embedding of most Q4 files so) is kept too, as
its int8 values and float16 scales (`INT8`, `SCALES`), for pdserve's int8 kernel
(`pdserve.engine.int8_kernel`): the LM head streams those 30 MB a step instead of 57 MB of
bf16 on the default model.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K
from safetensors.numpy import save_file

from pdserve.engine.gguf_architectures import PIECE, ArchitectureRules, hf_tensors

GROUP_SIZE = 32
"""Input features per scale and min."""
INT4_TYPES = tuple(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q4_K"))
"""GGUF types kept as int4: exact, one scale and min per group of 32."""
INT4_FILE = "int4/model.safetensors"
"""Where a converted directory keeps its int4 tensors (beside, not among, ``*.safetensors``)."""
VALUES, SCALES, MINS = ".int4", ".scales", ".mins"
"""Suffixes of a weight's three tensors in `INT4_FILE` (``<name>.weight.int4`` and so on)."""
INT8 = ".int8"
"""Suffix of a Q8_0 weight's int8 values in `INT4_FILE` (its float16 scales: `SCALES`)."""
INT8_TYPES = (GGMLQuantizationType.Q8_0,)
"""GGUF types kept as int8: exact, one float16 scale per group of 32."""
INT8_NAMES = frozenset({"model.embed_tokens.weight", "lm_head.weight"})
"""The weights kept as int8 where the file holds them so: the embedding and the LM head."""
TYPES_KEY, COUNTS_KEY = "gguf_types", "gguf_type_counts"
"""`INT4_FILE` metadata: each kept weight's GGUF type; the file's tensors per type."""
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}


class Int4Blocks(NamedTuple):
    """One weight's int4 groups.

    Attributes:
        values: ``[..., rows, cols / 2]`` uint8: column ``2i`` in the low nibble, ``2i + 1`` in
            the high one.
        scales: ``[..., rows, cols / 32]`` float32.
        mins: ``[..., rows, cols / 32]`` float32.
    """

    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray


def int4_blocks(data: np.ndarray, tensor_type: GGMLQuantizationType) -> Int4Blocks:
    """Reads a Q4_0 / Q4_1 / Q4_K tensor's raw blocks (``[..., rows, bytes per row]`` uint8, as
    ``GGUFReader`` holds them) into `Int4Blocks`.

    Raises:
        ValueError: For another type.
    """
    if tensor_type not in INT4_TYPES:
        raise ValueError(f"GGUF type {tensor_type.name} is not kept as int4")
    leading = data.shape[:-1]
    blocks = np.ascontiguousarray(data).reshape(-1, _BLOCK_BYTES[tensor_type.name])
    num_blocks = blocks.shape[0]
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if tensor_type == GGMLQuantizationType.Q4_K:
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        scales = d * sc.astype(np.float32)
        mins = -(dmin * mn.astype(np.float32))
        # qs: [blocks, 4, 32]; byte j of chunk i holds group 2i's j-th value low, 2i+1's high
        qs = blocks[:, 16:].reshape(num_blocks, 4, 1, 32)
    else:
        if tensor_type == GGMLQuantizationType.Q4_0:
            scales, mins = d, np.float32(-8) * d
        else:
            scales, mins = d, blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        # qs: [blocks, 16]; byte j holds value j low and value j + 16 high
        qs = blocks[:, -16:].reshape(num_blocks, 1, 1, 16)
    q = (qs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    q = q.reshape(*leading, -1)
    values = q[..., 0::2] | (q[..., 1::2] << np.uint8(4))
    num_groups = q.shape[-1] // GROUP_SIZE
    return Int4Blocks(
        values, scales.reshape(*leading, num_groups), mins.reshape(*leading, num_groups)
    )


class Int8Blocks(NamedTuple):
    """One weight's Q8_0 groups, ``scale * value``.

    Attributes:
        values: ``[..., rows, cols]`` int8.
        scales: ``[..., rows, cols / 32]`` float16, as the file stores them.
    """

    values: np.ndarray
    scales: np.ndarray


def int8_blocks(data: np.ndarray, tensor_type: GGMLQuantizationType) -> Int8Blocks:
    """Reads a Q8_0 tensor's raw blocks (``[..., rows, bytes per row]`` uint8, as
    ``GGUFReader`` holds them: per 32 values a float16 ``d``, then 32 int8) into `Int8Blocks`.

    Raises:
        ValueError: For another type.
    """
    if tensor_type not in INT8_TYPES:
        raise ValueError(f"GGUF type {tensor_type.name} is not kept as int8")
    leading = data.shape[:-1]
    # blocks: [blocks, 34]
    blocks = np.ascontiguousarray(data).reshape(-1, 2 + GROUP_SIZE)
    scales = blocks[:, :2].copy().view(np.float16)
    values = blocks[:, 2:].copy().view(np.int8)
    return Int8Blocks(values.reshape(*leading, -1), scales.reshape(*leading, -1))


def dequantize_int8(blocks: Int8Blocks) -> np.ndarray:
    """The float32 weight ``scale * value``: what ``gguf.quants.dequantize`` gives."""
    scales = np.repeat(blocks.scales.astype(np.float32), GROUP_SIZE, axis=-1)
    return blocks.values.astype(np.float32) * scales


def int8_tensors(
    reader: GGUFReader, rules: ArchitectureRules, config: Mapping[str, Any]
) -> Iterator[tuple[str, str, Int8Blocks]]:
    """Yields (Hugging Face weight name, GGUF type name, blocks) for the embedding and the LM
    head where the file holds them as Q8_0 (`INT8_NAMES`)."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in INT8_TYPES:
            continue
        blocks = int8_blocks(np.asarray(tensor.data), tensor.tensor_type)
        parts = [hf_tensors(tensor.name, part, rules, config) for part in blocks]
        for (name, values), (_, scales) in zip(*parts, strict=True):
            if name in INT8_NAMES:
                yield name, tensor.tensor_type.name, Int8Blocks(values, scales)


def unpack(values: np.ndarray) -> np.ndarray:
    """``[..., cols / 2]`` packed nibbles -> ``[..., cols]`` uint8 values in 0..15."""
    pairs = np.stack([values & np.uint8(0x0F), values >> np.uint8(4)], axis=-1)
    return pairs.reshape(*values.shape[:-1], -1)


def dequantize(blocks: Int4Blocks) -> np.ndarray:
    """The float32 weight ``scale * q + min``: what ``gguf.quants.dequantize`` gives."""
    scales = np.repeat(blocks.scales, GROUP_SIZE, axis=-1)
    mins = np.repeat(blocks.mins, GROUP_SIZE, axis=-1)
    return unpack(blocks.values).astype(np.float32) * scales + mins


def int4_tensors(
    reader: GGUFReader, rules: ArchitectureRules, config: Mapping[str, Any]
) -> Iterator[tuple[str, str, Int4Blocks]]:
    """Yields (Hugging Face weight name, GGUF type name, blocks) for every int4-typed tensor,
    renamed and reordered as `hf_tensors` does the dequantized ones; a piece of a tensor
    llama.cpp split is left to the dequantized checkpoint."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in INT4_TYPES:
            continue
        blocks = int4_blocks(np.asarray(tensor.data), tensor.tensor_type)
        parts = [hf_tensors(tensor.name, part, rules, config) for part in blocks]
        for (name, values), (_, scales), (_, mins) in zip(*parts, strict=True):
            if PIECE in name:
                continue
            yield name, tensor.tensor_type.name, Int4Blocks(values, scales, mins)


def write_int4_file(
    reader: GGUFReader, rules: ArchitectureRules, config: Mapping[str, Any], out_dir: Path
) -> dict[str, int]:
    """Writes `INT4_FILE` under `out_dir` (every int4-typed tensor, a Q8_0 embedding and LM
    head, and the file's type counts); returns how many tensors of each type the file kept."""
    tensors: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for name, type_name, blocks in int4_tensors(reader, rules, config):
        types[name] = type_name
        tensors[name + VALUES] = np.ascontiguousarray(blocks.values)
        tensors[name + SCALES] = np.ascontiguousarray(blocks.scales)
        tensors[name + MINS] = np.ascontiguousarray(blocks.mins)
    for name, type_name, int8 in int8_tensors(reader, rules, config):
        types[name] = type_name
        tensors[name + INT8] = np.ascontiguousarray(int8.values)
        tensors[name + SCALES] = np.ascontiguousarray(int8.scales)
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    path = out_dir / INT4_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", TYPES_KEY: json.dumps(types), COUNTS_KEY: json.dumps(counts)}
    save_file(tensors, str(path), metadata=metadata)
    return dict(Counter(types.values()))
