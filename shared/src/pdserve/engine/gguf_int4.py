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
Q8_0, Q6_K and Q5_K have 5 to 8-bit values or groups of 16 that torch's int4 kernel cannot
hold exactly; they are kept as int8 (`INT8`, `SCALES`, `MINS`) for pdserve's int8 kernel
(`pdserve.engine.int8_kernel`), as exactly:

* Q8_0: ``d * q``, an int8 ``q`` and a float16 ``d`` per group of 32 (as the file stores them);
* Q6_K: 256-weight super-blocks of 16 groups of 16, ``d * sc * (q - 32)`` with an int8 ``sc``:
  int8 ``q - 32`` and a float32 scale ``d * sc`` per group of 16;
* Q5_K: as Q4_K with 5-bit ``q``: int8 ``q``, float32 ``scale = d * sc`` and
  ``min = -(dmin * mn)`` per group of 32.

Other types (Q2_K, Q3_K, ...) stay in the dequantized checkpoint.
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
INT8_TYPES = tuple(GGMLQuantizationType[name] for name in ("Q8_0", "Q6_K", "Q5_K"))
"""GGUF types kept as int8: exact, a scale (and for Q5_K a min) per group of 16 or 32."""
INT8_GROUP_SIZES = {"Q8_0": 32, "Q6_K": 16, "Q5_K": 32}
"""Input features per scale of each int8 type."""
TYPES_KEY, COUNTS_KEY = "gguf_types", "gguf_type_counts"
"""`INT4_FILE` metadata: each kept weight's GGUF type; the file's tensors per type."""
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34, "Q6_K": 210, "Q5_K": 176}


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


def _raw_blocks(
    data: np.ndarray,
    tensor_type: GGMLQuantizationType,
    kept: tuple[GGMLQuantizationType, ...],
    kind: str,
) -> tuple[tuple[int, ...], np.ndarray]:
    """A tensor's leading dims (``data``'s but the last) and its raw blocks, one a row
    (``[blocks, bytes per block]`` uint8).

    Raises:
        ValueError: If `tensor_type` is not one of `kept` (the types kept as `kind`).
    """
    if tensor_type not in kept:
        raise ValueError(f"GGUF type {tensor_type.name} is not kept as {kind}")
    blocks = np.ascontiguousarray(data).reshape(-1, _BLOCK_BYTES[tensor_type.name])
    return data.shape[:-1], blocks


def int4_blocks(data: np.ndarray, tensor_type: GGMLQuantizationType) -> Int4Blocks:
    """Reads a Q4_0 / Q4_1 / Q4_K tensor's raw blocks (``[..., rows, bytes per row]`` uint8, as
    ``GGUFReader`` holds them) into `Int4Blocks`.

    Raises:
        ValueError: For another type.
    """
    leading, blocks = _raw_blocks(data, tensor_type, INT4_TYPES, "int4")
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
    """One weight's int8 groups, ``scale * value + min``.

    Attributes:
        values: ``[..., rows, cols]`` int8.
        scales: ``[..., rows, cols / group]``: Q8_0's float16 ``d`` as the file stores them
            (groups of 32), Q6_K's float32 ``d * sc`` (groups of 16), Q5_K's float32 ``d * sc``
            (groups of 32).
        mins: ``[..., rows, cols / 32]`` float32 (Q5_K's ``-dmin * m``), or None.
    """

    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None = None


def int8_blocks(data: np.ndarray, tensor_type: GGMLQuantizationType) -> Int8Blocks:
    """Reads a Q8_0, Q6_K or Q5_K tensor's raw blocks (``[..., rows, bytes per row]`` uint8, as
    ``GGUFReader`` holds them) into `Int8Blocks`, every value exact: Q8_0's int8 ``q`` and
    float16 ``d``; Q6_K's ``q - 32`` (-32..31) with ``d * sc`` (a float16 times an int8, exact in
    float32); Q5_K's ``q`` (0..31) with ``d * sc`` and ``-dmin * m`` (6-bit ``sc`` and ``m``).

    Raises:
        ValueError: For another type.
    """
    leading, blocks = _raw_blocks(data, tensor_type, INT8_TYPES, "int8")
    num_blocks = blocks.shape[0]
    scales: np.ndarray
    mins = None
    if tensor_type == GGMLQuantizationType.Q8_0:
        # blocks: [blocks, 34]: d, then 32 int8
        scales = blocks[:, :2].copy().view(np.float16)
        values = blocks[:, 2:].copy().view(np.int8)
    elif tensor_type == GGMLQuantizationType.Q6_K:
        # blocks: [blocks, 210]: ql[128] qh[64] scales[16] (int8) d
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
        scales = d * sc
        low = ql.reshape(num_blocks, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        low = (low & np.uint8(0x0F)).reshape(num_blocks, -1, 32)
        high = qh.reshape(num_blocks, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1
        )
        high = (high & np.uint8(0x03)).reshape(num_blocks, -1, 32)
        values = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    else:
        # blocks: [blocks, 176]: d dmin scales[12] qh[32] qs[128]
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        scales = d * sc.astype(np.float32)
        mins = -(dmin * mn.astype(np.float32))
        qh, qs = blocks[:, 16:48], blocks[:, 48:]
        low = qs.reshape(num_blocks, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        low = (low & np.uint8(0x0F)).reshape(num_blocks, -1, 32)
        high = qh.reshape(num_blocks, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        high = (high & np.uint8(0x01)).reshape(num_blocks, -1, 32)
        values = (low | (high << np.uint8(4))).astype(np.int8)
    values = values.reshape(*leading, -1)
    num_groups = values.shape[-1] // INT8_GROUP_SIZES[tensor_type.name]
    return Int8Blocks(
        values,
        scales.reshape(*leading, num_groups),
        None if mins is None else mins.reshape(*leading, num_groups),
    )


def dequantize_int8(blocks: Int8Blocks) -> np.ndarray:
    """The float32 weight ``scale * value + min``: what ``gguf.quants.dequantize`` gives."""
    group = blocks.values.shape[-1] // blocks.scales.shape[-1]
    scales = np.repeat(blocks.scales.astype(np.float32), group, axis=-1)
    weight = blocks.values.astype(np.float32) * scales
    if blocks.mins is not None:
        weight = weight + np.repeat(blocks.mins, group, axis=-1)
    return weight


def int8_tensors(
    reader: GGUFReader, rules: ArchitectureRules, config: Mapping[str, Any]
) -> Iterator[tuple[str, str, Int8Blocks]]:
    """Yields (Hugging Face weight name, GGUF type name, blocks) for every int8-typed tensor
    (`INT8_TYPES`), renamed and reordered as `hf_tensors` does the dequantized ones; a piece of
    a tensor llama.cpp split is left to the dequantized checkpoint."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in INT8_TYPES:
            continue
        blocks = int8_blocks(np.asarray(tensor.data), tensor.tensor_type)
        parts = [
            hf_tensors(tensor.name, part, rules, config) for part in blocks if part is not None
        ]
        for named in zip(*parts, strict=True):
            name = named[0][0]
            if PIECE in name:
                continue
            arrays = [array for _, array in named]
            yield name, tensor.tensor_type.name, Int8Blocks(*arrays)


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
    """Writes `INT4_FILE` under `out_dir` (every int4- and int8-typed tensor, and the file's
    type counts); returns how many tensors of each type the file kept."""
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
        if int8.mins is not None:
            tensors[name + MINS] = np.ascontiguousarray(int8.mins)
    counts = Counter(t.tensor_type.name for t in reader.tensors)
    path = out_dir / INT4_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", TYPES_KEY: json.dumps(types), COUNTS_KEY: json.dumps(counts)}
    save_file(tensors, str(path), metadata=metadata)
    return dict(Counter(types.values()))
