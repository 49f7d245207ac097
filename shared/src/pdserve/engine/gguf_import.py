"""Turns a GGUF file into a Hugging Face model directory the engine loads.

llama.cpp's GGUF holds the config and the tokenizer as metadata and the weights, often
quantized, under its own tensor names. `convert_gguf` reads it with the `gguf` package (the
field's reader), dequantizes every tensor to float32, renames it to the Hugging Face name, undoes
the row permutation llama.cpp applies to the Llama query and key projections, and writes
``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json``. The result equals what transformers loads from the same GGUF.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from pdserve.tokenizer.gguf_vocab import GgufVocab, tokenizer_files

log = structlog.get_logger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_TENSOR_TYPES = tuple(
    GGMLQuantizationType[name]
    for name in (
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    )
)  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

ProgressFactory = Callable[[int, str], Any]
"""Makes a progress bar: called with (total, description); the result has update() and close()."""


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every metadata field of the file as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The Hugging Face ``config.json`` object the GGUF metadata describes.

    Raises:
        ValueError: For an architecture or setting pdserve does not implement.
    """
    arch = str(metadata.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (general.architecture); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF per-frequency RoPE factors (rope_freqs) are not supported")

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"the GGUF file lacks {arch}.{key}")
        return value

    num_heads = int(get("attention.head_count"))
    hidden_size = int(get("embedding_length"))
    vocab_size = metadata.get(f"{arch}.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": arch,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden_size // num_heads)),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": "float32",
    }
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"unsupported GGUF RoPE scaling {scaling!r}; supported: linear")
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(get("rope.scaling.factor")),
        }
    for key in ("bos_token_id", "eos_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    return config


def gguf_vocab(metadata: dict[str, Any]) -> GgufVocab:
    """The tokenizer metadata of the file.

    Raises:
        ValueError: For a tokenizer model pdserve cannot rebuild.
    """

    def optional_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    return GgufVocab(
        model=str(metadata.get("tokenizer.ggml.model", "")),
        tokens=list(metadata.get("tokenizer.ggml.tokens") or ()),
        token_types=[int(t) for t in metadata.get("tokenizer.ggml.token_type") or ()],
        merges=list(metadata.get("tokenizer.ggml.merges") or ()),
        pre=str(metadata.get("tokenizer.ggml.pre", "default")),
        bos_token_id=optional_id("bos_token_id"),
        eos_token_id=optional_id("eos_token_id"),
        unk_token_id=optional_id("unknown_token_id"),
        pad_token_id=optional_id("padding_token_id"),
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name.

    Raises:
        ValueError: For a tensor pdserve's models do not have.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's reordering of a Llama q/k projection's rows (weight or bias).

    llama.cpp interleaves the two rotary halves of each head (``[h, 2, d/2] -> [h, d/2, 2]``);
    the Hugging Face layout, which the engine uses, keeps them as halves.
    """
    # weight: [num_heads * head_dim, ...]
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def dequantized_tensors(
    reader: GGUFReader, config: dict[str, Any], progress: Any = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (Hugging Face name, float32 array) for every tensor of the file.

    Raises:
        ValueError: For an unsupported tensor type or an unexpected tensor.
    """
    permuted = {
        "self_attn.q_proj": config["num_attention_heads"],
        "self_attn.k_proj": config["num_key_value_heads"],
    }
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
            raise ValueError(
                f"tensor {tensor.name!r} has unsupported GGUF type {tensor.tensor_type.name}; "
                f"supported: {supported}"
            )
        name = hf_tensor_name(tensor.name)
        values = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), np.float32)
        values = values.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        if config["model_type"] == "llama":
            for part, num_heads in permuted.items():
                if f".{part}." in name:
                    values = np.ascontiguousarray(unpermute_rows(values, num_heads))
        if progress is not None:
            progress.update(1)
        yield name, values


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
    config = hf_config(metadata, {t.name for t in reader.tensors})
    vocab = gguf_vocab(metadata)
    progress = None
    if make_progress is not None:
        progress = make_progress(len(reader.tensors), f"preparing {path.name}")
    try:
        weights = dict(dequantized_tensors(reader, config, progress))
    finally:
        if progress is not None:
            progress.close()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
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
    )
