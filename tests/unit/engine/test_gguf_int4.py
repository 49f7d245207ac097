"""A GGUF's 4-bit weights kept as the file stores them: the values, the kernel, the engine.

Q4_0, Q4_1 and Q4_K map onto int4 groups of 32 with a scale and a min; read back (in numpy, and
through an int4 kernel with float32 activations: pdserve's where it runs, else torch's) they
must be the values the ``gguf`` package dequantizes. With bf16 activations torch's kernel's
scales are bf16 (it takes them in the activation dtype), so there they are close, not equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from safetensors import safe_open
from safetensors.numpy import save_file
from structlog.testing import capture_logs
from support.converted_gguf import converted_tiny_gguf, prompt_logits
from support.gguf_files import NUM_LAYERS, TinyGgufSpec, random_weight

from pdserve.engine import cpu_kernels
from pdserve.engine.gguf_int4 import INT4_FILE, INT4_TYPES, TYPES_KEY, dequantize, int4_blocks
from pdserve.engine.linear import Linear
from pdserve.engine.quant import Int4Linear

INT4_IDS = [t.name for t in INT4_TYPES]


def file_weight(tensor_type: GGMLQuantizationType, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks, the gguf package's float32 weight) of a random [64, 256] weight."""
    raw = random_weight(np.random.default_rng(seed), (64, 256), tensor_type)
    return raw, gguf_dequantize(raw, tensor_type).reshape(64, 256)


def kernel_weight(
    raw: np.ndarray, tensor_type: GGMLQuantizationType, dtype: torch.dtype
) -> torch.Tensor:
    """The [out, in] weight torch's int4 kernel computes with, read out by an identity input."""
    values, scales, mins = (torch.from_numpy(part) for part in int4_blocks(raw, tensor_type))
    linear = Int4Linear.from_blocks(values, scales, mins, None, dtype)
    return linear(torch.eye(256, dtype=dtype)).t().float()


@pytest.mark.parametrize("tensor_type", INT4_TYPES, ids=INT4_IDS)
def test_blocks_hold_the_files_values(tensor_type: GGMLQuantizationType) -> None:
    raw, expected = file_weight(tensor_type)
    values = dequantize(int4_blocks(raw, tensor_type))
    # NOTE: equal as values; bit for bit but for the sign of a zero: gguf's Q4_0 computes
    # d * (q - 8), which is -0.0 for q = 8 and a negative d, where scale * q + min is +0.0.
    assert np.array_equal(values, expected)
    nonzero = expected != 0
    assert np.array_equal(values[nonzero].view(np.uint32), expected[nonzero].view(np.uint32))


@pytest.mark.parametrize("tensor_type", INT4_TYPES, ids=INT4_IDS)
def test_the_float32_kernel_computes_with_the_files_values(
    tensor_type: GGMLQuantizationType,
) -> None:
    raw, expected = file_weight(tensor_type, seed=1)
    assert torch.equal(kernel_weight(raw, tensor_type, torch.float32), torch.from_numpy(expected))


@pytest.mark.parametrize("tensor_type", INT4_TYPES, ids=INT4_IDS)
def test_the_bf16_kernel_is_within_its_scales_rounding(tensor_type: GGMLQuantizationType) -> None:
    raw, expected = file_weight(tensor_type, seed=2)
    blocks = int4_blocks(raw, tensor_type)
    error = (kernel_weight(raw, tensor_type, torch.bfloat16) - torch.from_numpy(expected)).abs()
    # bf16 rounds to within 2^-8 of a value: the scale (a weight's error is at most 15 of
    # the scale's, the zero taking the group's mean), the zero and the output.
    scales = torch.from_numpy(blocks.scales).abs().repeat_interleave(32, dim=1)
    mins = torch.from_numpy(blocks.mins).abs().repeat_interleave(32, dim=1)
    bound = 2**-8 * (15 * scales + (mins + 8 * scales) + torch.from_numpy(expected).abs())
    assert (error <= bound).all()
    assert error.max() > 0  # bf16 cannot hold every fp16 scale


def converted(
    tmp_path: Path, tensor_type: GGMLQuantizationType, architecture: str = "llama"
) -> Path:
    return converted_tiny_gguf(
        tmp_path, TinyGgufSpec(architecture=architecture, tensor_type=tensor_type)
    )


@pytest.mark.parametrize(
    ("architecture", "tensor_type"),
    [
        ("llama", GGMLQuantizationType.Q4_1),  # q/k rows un-permuted
        ("llama", GGMLQuantizationType.Q4_K),
        ("qwen2", GGMLQuantizationType.Q4_0),  # q/k/v biases
    ],
    ids=["llama-Q4_1", "llama-Q4_K", "qwen2-Q4_0"],
)
def test_auto_serves_the_files_int4_weights_in_bf16(
    tmp_path: Path, architecture: str, tensor_type: GGMLQuantizationType
) -> None:
    model_dir = converted(tmp_path, tensor_type, architecture)
    with capture_logs() as logs:
        kept, kept_logits = prompt_logits(model_dir, "bfloat16", "auto")
    _, bf16_logits = prompt_logits(model_dir, "bfloat16", "none")
    _, exact_logits = prompt_logits(model_dir, "float32", "auto")

    # every layer's projection runs on the int4 kernel; the LM head's 314 rows are no multiple
    # of 16, which the kernel needs, so it is dequantized (as is the embedding, a lookup)
    layers = kept.model.model.layers
    projections = [m for m in layers.modules() if isinstance(m, (Linear, Int4Linear))]
    assert len(projections) == 4 * NUM_LAYERS
    assert all(isinstance(m, Int4Linear) for m in projections)
    assert isinstance(kept.model.lm_head, Linear)
    [loaded] = [e for e in logs if e["event"] == "model_loaded"]
    num_kept = 7 * NUM_LAYERS  # q, k, v, o, gate, up, down of each layer
    assert loaded["tensor_types"] == {
        "F32": "bfloat16",
        tensor_type.name: f"int4 ({num_kept} of {num_kept + 2}), else bfloat16",
    }
    # as close to the file's exact values (float32) as the same file dequantized to bf16
    kept_error = (kept_logits - exact_logits).abs()
    bf16_error = (bf16_logits - exact_logits).abs()
    assert kept_error.max() <= 2 * bf16_error.max()
    assert kept_error.mean() <= 2 * bf16_error.mean()


def test_none_and_float32_without_its_kernel_dequantize_the_files_int4_weights(
    tmp_path: Path,
) -> None:
    """``none`` dequantizes; so does float32 ``auto`` where pdserve's float32 kernels do not run
    (torch's int4 kernel is 16-40x slower than a float32 GEMM with float32 activations; where
    they run, `test_f32_kernels` has the kept path)."""
    model_dir = converted(tmp_path, GGMLQuantizationType.Q4_0)
    for dtype, quantization in (("float32", "auto"), ("bfloat16", "none")):
        with (
            capture_logs() as logs,
            mock.patch.object(cpu_kernels, "f32_available", return_value=False),
        ):
            runner, _ = prompt_logits(model_dir, dtype, quantization)
        assert not any(isinstance(m, Int4Linear) for m in runner.model.modules())
        [loaded] = [e for e in logs if e["event"] == "model_loaded"]
        assert loaded["tensor_types"] == {"F32": dtype, "Q4_0": dtype}


def test_a_projection_with_a_part_of_another_type_is_dequantized(tmp_path: Path) -> None:
    """As in a Q4_K_M file, where some layers' attn_v is Q6_K: that layer's fused q/k/v
    projection runs dequantized, every other projection on the file's int4 values."""
    model_dir = converted(tmp_path, GGMLQuantizationType.Q4_1)
    int4_file = model_dir / INT4_FILE
    with safe_open(str(int4_file), framework="numpy") as reader:
        metadata = reader.metadata()
        tensors = {name: reader.get_tensor(name) for name in reader.keys()}  # noqa: SIM118
    v_name = "model.layers.0.self_attn.v_proj.weight"
    types = json.loads(metadata[TYPES_KEY])
    del types[v_name]
    tensors = {name: t for name, t in tensors.items() if not name.startswith(v_name)}
    save_file(tensors, str(int4_file), metadata={**metadata, TYPES_KEY: json.dumps(types)})
    with capture_logs() as logs:
        kept, kept_logits = prompt_logits(model_dir, "bfloat16", "auto")
    _, bf16_logits = prompt_logits(model_dir, "bfloat16", "none")

    model = kept.model
    assert isinstance(model.get_submodule("model.layers.0.self_attn.qkv_proj"), Linear)
    assert isinstance(model.get_submodule("model.layers.0.self_attn.o_proj"), Int4Linear)
    assert isinstance(model.get_submodule("model.layers.1.self_attn.qkv_proj"), Int4Linear)
    [loaded] = [e for e in logs if e["event"] == "model_loaded"]
    assert loaded["tensor_types"]["Q4_1"] == "int4 (11 of 15), else bfloat16"
    # NOTE: this random model's logits spread over tens; the kept and the bf16 weights differ
    # by their roundings only (a wrong row order in a projection would move them by units).
    difference = (kept_logits - bf16_logits).abs()
    assert difference.max() <= 3.0 and difference.mean() <= 0.5
