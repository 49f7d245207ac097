"""Turns a GGUF file into a Hugging Face model directory the engine loads.

llama.cpp's GGUF holds the config and the tokenizer as metadata and the weights, often
quantized, under its own tensor names. `convert_gguf` reads it with the `gguf` package (the
field's reader), dequantizes every tensor to float32, renames it to the Hugging Face name and
undoes what llama.cpp changed (per family, `pdserve.engine.families`; MXFP4 experts stay
MXFP4, `mxfp4_tensors`), and writes
``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json``. The result equals what transformers loads from the same GGUF.
Beside it, `pdserve.engine.gguf_int4` keeps the 4-bit tensors as the file stores them
(``int4/model.safetensors``), for the engine's int4 kernels.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import structlog
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from pdserve.engine.families import gguf_family, supported_architectures
from pdserve.engine.gguf_architectures import ArchitectureRules, hf_checkpoint
from pdserve.engine.gguf_config import hf_config
from pdserve.engine.gguf_int4 import write_int4_file
from pdserve.engine.packed_weights import BLOCKS, SCALES
from pdserve.tokenizer.gguf_vocab import GgufVocab, tokenizer_files

log = structlog.get_logger(__name__)

# NOTE: MXFP4 (gpt-oss's experts as released) holds 4-bit e2m1 values with one e8m0 (power of
# two) scale per 32: every weight is exact in float32.
SUPPORTED_TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16", "Q8_0", "MXFP4", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)  # fmt: skip

__all__ = [
    "SUPPORTED_TENSOR_TYPES",
    "convert_gguf",
    "dequantized_tensors",
    "gguf_vocab",
    "read_metadata",
    "supported_architectures",
]

ProgressFactory = Callable[[int, str], Any]
"""Makes a progress bar: called with (total, description); the result has update() and close()."""


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata field of the file as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def gguf_vocab(metadata: dict[str, Any]) -> GgufVocab:
    """The tokenizer metadata of the file.

    Raises:
        ValueError: For a tokenizer model pdserve cannot rebuild.
    """

    def optional_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    model = str(metadata.get("tokenizer.ggml.model", ""))
    # NOTE: llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
    # (older files have no flag); transformers does the same.
    add_bos_default = model == "llama"
    return GgufVocab(
        model=model,
        tokens=list(metadata.get("tokenizer.ggml.tokens") or ()),
        token_types=[int(t) for t in metadata.get("tokenizer.ggml.token_type") or ()],
        merges=list(metadata.get("tokenizer.ggml.merges") or ()),
        scores=[float(s) for s in metadata.get("tokenizer.ggml.scores") or ()],
        architecture=str(metadata.get("general.architecture", "")),
        pre=str(metadata.get("tokenizer.ggml.pre", "default")),
        bos_token_id=optional_id("bos_token_id"),
        eos_token_id=optional_id("eos_token_id"),
        unk_token_id=optional_id("unknown_token_id"),
        pad_token_id=optional_id("padding_token_id"),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


MXFP4_BLOCK_BYTES = 17
"""ggml's MXFP4 block: its e8m0 scale byte, then 16 bytes of 4-bit e2m1 codes (value ``j`` in
byte ``j``'s low nibble, value ``j + 16`` in its high one)."""


def released_mxfp4(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's MXFP4 blocks (``[..., rows, bytes]`` uint8) as the released checkpoints hold the
    same values: ``[..., rows, blocks, 16]`` codes with value ``2j`` in byte ``j``'s low nibble
    and ``2j + 1`` in its high one, and ``[..., rows, blocks]`` e8m0 scales (the same bytes:
    ggml's ``2 * e2m1 * 2 ** (e - 128)`` is ``e2m1 * 2 ** (e - 127)``)."""
    rows = data.shape[:-1]
    blocks = data.reshape(*rows, -1, MXFP4_BLOCK_BYTES)
    nibbles = blocks[..., 1:]
    # codes: [..., blocks, 32] in order
    codes = np.concatenate((nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)), axis=-1)
    packed = codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))
    return np.ascontiguousarray(packed), np.ascontiguousarray(blocks[..., 0])


class Mxfp4Tensors(NamedTuple):
    """A file's MXFP4 tensors kept packed (`mxfp4_tensors`).

    Attributes:
        gguf_names: The GGUF tensors they came from (left out of the dequantized ones).
        tensors: Hugging Face name (``<name>_blocks``, ``<name>_scales``) -> array.
    """

    gguf_names: frozenset[str]
    tensors: dict[str, np.ndarray]


def mxfp4_tensors(
    reader: GGUFReader, rules: ArchitectureRules, config: Mapping[str, Any]
) -> Mxfp4Tensors:
    """The file's MXFP4 tensors in the released checkpoints' form (``<name>_blocks``,
    ``<name>_scales``; `released_mxfp4`), pieces joined by `hf_checkpoint` with the family's
    `ArchitectureRules.join_mxfp4` (blocks and scales each alone); none where the family has no
    such join (its MXFP4 tensors are then dequantized like the others).

    Raises:
        ValueError: For an MXFP4 tensor that is no piece the family joins, or a stack whose
            pieces the file does not all hold.
    """
    if rules.join_mxfp4 is None:
        return Mxfp4Tensors(frozenset(), {})
    # suffix -> GGUF name -> that half of the tensor
    halves: dict[str, dict[str, np.ndarray]] = {BLOCKS: {}, SCALES: {}}
    for tensor in reader.tensors:
        if tensor.tensor_type == GGMLQuantizationType.MXFP4:
            blocks, scales = released_mxfp4(np.asarray(tensor.data))
            halves[BLOCKS][tensor.name], halves[SCALES][tensor.name] = blocks, scales
    names = frozenset(halves[BLOCKS])
    joining = dataclasses.replace(rules, join=rules.join_mxfp4)
    joined_suffixes = {suffix for suffix, _ in rules.pieces.values()}
    tensors: dict[str, np.ndarray] = {}
    for suffix, by_name in halves.items():
        # NOTE: each piece let go of as it is handed over: a stack's pieces are not held
        # beside the stack they are joined into once it is.
        pieces = ((name, by_name.pop(name)) for name in list(by_name))
        for hf_name, array in hf_checkpoint(pieces, joining, config):
            if hf_name.split(".", 3)[-1] not in joined_suffixes:
                raise ValueError(f"MXFP4 tensor {hf_name!r} is no piece of an expert stack")
            tensors[hf_name + suffix] = array
    return Mxfp4Tensors(names, tensors)


def dequantized_tensors(
    reader: GGUFReader,
    rules: ArchitectureRules,
    config: dict[str, Any],
    progress: Any = None,
    skip: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (Hugging Face name, float32 array) for every tensor of the file but those named
    in `skip` (GGUF names).

    Raises:
        ValueError: For an unsupported tensor type or an unexpected tensor.
    """

    def dequantized() -> Iterator[tuple[str, np.ndarray]]:
        for tensor in reader.tensors:
            if tensor.name in skip:
                if progress is not None:
                    progress.update(1)
                continue
            if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
                supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
                raise ValueError(
                    f"tensor {tensor.name!r} has unsupported GGUF type "
                    f"{tensor.tensor_type.name}; supported: {supported}"
                )
            values = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
            yield tensor.name, values.reshape(tuple(int(n) for n in reversed(tensor.shape)))
            if progress is not None:
                progress.update(1)

    yield from hf_checkpoint(dequantized(), rules, config)


def convert_gguf(
    gguf_path: str | Path, out_dir: str | Path, make_progress: ProgressFactory | None = None
) -> None:
    """Writes a Hugging Face model directory for `gguf_path` into the existing `out_dir`.

    Args:
        gguf_path: A llama.cpp GGUF file.
        out_dir: An empty directory.
        make_progress: Makes a progress bar over the tensors, if given.

    Raises:
        ValueError: If the file is not a GGUF pdserve can serve; the message names what is
            unsupported and lists what is.
    """
    path, out = Path(gguf_path), Path(out_dir)
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error
    metadata = read_metadata(reader)
    family = gguf_family(metadata)
    assert family.gguf is not None
    rules = family.gguf.tensors
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    config = hf_config(
        metadata,
        {t.name for t in reader.tensors},
        None if rope_freqs is None else dequantize(rope_freqs.data, rope_freqs.tensor_type),
    )
    vocab = gguf_vocab(metadata)
    progress = None
    if make_progress is not None:
        progress = make_progress(len(reader.tensors), f"preparing {path.name}")
    packed = mxfp4_tensors(reader, rules, config)
    if packed.tensors:
        # NOTE: the released checkpoints' form: the loader keeps them as int8 groups or
        # dequantizes them (`pdserve.engine.packed_weights`)
        config["quantization_config"] = {"quant_method": "mxfp4"}
    try:
        weights = dict(dequantized_tensors(reader, rules, config, progress, packed.gguf_names))
        weights |= packed.tensors
    finally:
        if progress is not None:
            progress.close()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    int4_counts = write_int4_file(reader, rules, config, out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id") if key in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer_json, tokenizer_config = tokenizer_files(vocab)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(tokenizer_config + "\n", encoding="utf-8")
    log.info(
        "gguf_converted",
        source=path.name,
        architecture=config["model_type"],
        num_tensors=len(weights),
        tensor_types=sorted({t.tensor_type.name for t in reader.tensors}),
        int4_tensor_types=int4_counts,
    )
