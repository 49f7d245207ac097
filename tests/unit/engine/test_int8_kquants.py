"""A GGUF's Q8_0, Q6_K and Q5_K projections kept as the file stores them on pdserve's int8
kernel (`pdserve.engine.int8_kernel`): Q6_K as ``q - 32`` in groups of 16 with a float32 scale,
Q5_K with float32 scales and mins per group of 32, Q8_0 as int8 with float16 scales.

The K-quants' blocks are random bytes in the documented layout (``support.gguf_files``: gguf-py
has no numpy quantizer for them), checked against ``gguf.quants.dequantize``. The kernel needs
AVX512-BF16; where the CPU lacks it those tests skip, and the fallback runs everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from structlog.testing import capture_logs
from support.converted_gguf import converted_tiny_gguf
from support.converted_gguf import prompt_logits as load
from support.gguf_files import NUM_LAYERS, TinyGgufSpec, random_weight

from pdserve.engine import int8_kernel
from pdserve.engine.gguf_int4 import dequantize_int8, int4_blocks, int8_blocks
from pdserve.engine.int4_weights import int8_parts
from pdserve.engine.linear import Linear
from pdserve.engine.quant import OWN_KERNEL_MAX_ROWS, Int8GroupEmbedding, Int8GroupLinear

TYPES = [GGMLQuantizationType[name] for name in ("Q8_0", "Q6_K", "Q5_K")]
IDS = [t.name for t in TYPES]


def _cpu_has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512_bf16" in cpuinfo.read_text()


needs_kernel = pytest.mark.skipif(
    not _cpu_has_avx512_bf16(), reason="the kernel needs AVX512-BF16; the fallback runs here"
)


def kernels() -> list[Any]:
    return [pytest.param("pdserve", marks=needs_kernel), "torch"]


def file_weight(
    tensor_type: GGMLQuantizationType, rows: int, cols: int, seed: int
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """((values, scales, mins), the gguf package's float32 weight) of a random weight."""
    raw = random_weight(np.random.default_rng(seed), (rows, cols), tensor_type)
    expected = gguf_dequantize(raw, tensor_type).reshape(rows, cols)
    values, scales, mins = int8_blocks(raw, tensor_type)
    parts = (
        torch.from_numpy(values),
        torch.from_numpy(scales),
        None if mins is None else torch.from_numpy(mins),
    )
    return parts, torch.from_numpy(expected)


def linear_on(
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], kernel: str
) -> Int8GroupLinear:
    values, scales, mins = parts
    linear = Int8GroupLinear(values, scales, torch.bfloat16, mins)
    if kernel == "torch":
        linear.kernel = "torch"
    assert linear.kernel == kernel
    return linear


@pytest.mark.parametrize("tensor_type", TYPES, ids=IDS)
def test_blocks_hold_the_files_values(tensor_type: GGMLQuantizationType) -> None:
    raw = random_weight(np.random.default_rng(0), (64, 512), tensor_type)
    expected = gguf_dequantize(raw, tensor_type).reshape(64, 512)
    blocks = int8_blocks(raw, tensor_type)
    group = {"Q8_0": 32, "Q6_K": 16, "Q5_K": 32}[tensor_type.name]
    assert blocks.values.dtype == np.int8 and blocks.scales.shape == (64, 512 // group)
    assert (blocks.mins is not None) == (tensor_type.name == "Q5_K")
    assert np.array_equal(dequantize_int8(blocks).view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("kernel", kernels())
@pytest.mark.parametrize("tensor_type", TYPES, ids=IDS)
def test_one_hot_rows_read_the_files_values(tensor_type: GGMLQuantizationType, kernel: str) -> None:
    """Each weight read out by a one-hot row: the gguf package's float32 value rounded to bf16
    (up to `OWN_KERNEL_MAX_ROWS` rows on the kernel, more on the dequantized GEMM)."""
    parts, expected = file_weight(tensor_type, 200, 256, seed=1)
    linear = linear_on(parts, kernel)
    eye = torch.eye(256, dtype=torch.bfloat16)
    with torch.no_grad():
        few = torch.cat([linear(eye[i : i + OWN_KERNEL_MAX_ROWS]) for i in range(0, 256, 8)])
        many = linear(eye)
    assert torch.equal(few.t(), expected.to(torch.bfloat16))
    assert torch.equal(many.t(), expected.to(torch.bfloat16))


@pytest.mark.parametrize("kernel", kernels())
@pytest.mark.parametrize("tensor_type", TYPES, ids=IDS)
def test_the_embedding_reads_the_files_rows(tensor_type: GGMLQuantizationType, kernel: str) -> None:
    (values, scales, mins), expected = file_weight(tensor_type, 300, 256, seed=2)
    embedding = Int8GroupEmbedding(values, scales, torch.bfloat16, mins)
    embedding.kernel = kernel
    ids = torch.tensor([[5, 0], [299, 5]])
    assert torch.equal(embedding(ids), expected.to(torch.bfloat16)[ids])


@needs_kernel
@pytest.mark.parametrize("tensor_type", TYPES, ids=IDS)
def test_the_kernel_and_the_fallback_agree(tensor_type: GGMLQuantizationType) -> None:
    """Both within their roundings of the exact product; the kernel's float32 sums, rounded
    once, equal the exact product rounded in all but a few outputs."""
    parts, weight = file_weight(tensor_type, 1000, 1536, seed=5)
    x = torch.randn(32, 1536, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    exact = x.double() @ weight.double().t()
    own, fallback = linear_on(parts, "pdserve"), linear_on(parts, "torch")
    with torch.no_grad():
        for rows in (1, 3, 8, 32):
            ours, theirs = own(x[:rows]).double(), fallback(x[:rows]).double()
            scale = x[:rows].double().abs() @ weight.double().abs().t()
            bound = exact[:rows].abs() * 2**-7 + 2**-12 * scale
            assert ((ours - theirs).abs() <= 2 * bound).all(), rows
            if rows <= OWN_KERNEL_MAX_ROWS:
                equal = (ours == exact[:rows].to(torch.bfloat16).double()).float().mean()
                assert equal >= 0.98, (rows, equal)
            else:
                assert torch.equal(ours, theirs)  # more rows take the same dequantized GEMM


@needs_kernel
@pytest.mark.parametrize("tensor_type", TYPES, ids=IDS)
def test_a_row_gets_the_same_bits_alone_and_beside_any_number_of_rows(
    tensor_type: GGMLQuantizationType,
) -> None:
    (values, scales, mins), _ = file_weight(tensor_type, 250, 512, seed=7)
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    whole = int8_kernel.matmul(x, values, scales, mins)
    for rows in range(1, 13):
        assert torch.equal(int8_kernel.matmul(x[:rows], values, scales, mins), whole[:rows])
        alone = int8_kernel.matmul(x[rows : rows + 1], values, scales, mins)[0]
        assert torch.equal(alone, whole[rows]), rows


def test_a_fused_projection_of_int4_and_int8_parts_keeps_every_value() -> None:
    """As a Q4_K_M file's q/k (Q4_K) and v (Q6_K): one int8 layout in groups of 16 with float32
    scales and mins holds both exactly."""
    rng = np.random.default_rng(11)
    q4 = random_weight(rng, (64, 256), GGMLQuantizationType.Q4_K)
    q6 = random_weight(rng, (32, 256), GGMLQuantizationType.Q6_K)
    packed, scales4, mins4 = (
        torch.from_numpy(p) for p in int4_blocks(q4, GGMLQuantizationType.Q4_K)
    )
    values4 = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(1).to(torch.int8)
    values6, scales6 = (torch.from_numpy(p) for p in int8_blocks(q6, GGMLQuantizationType.Q6_K)[:2])
    values, scales, mins = int8_parts([(values4, scales4, mins4), (values6, scales6, None)])
    assert scales.shape == (96, 16) and scales.dtype == torch.float32 and mins is not None
    expected = np.concatenate(
        [
            gguf_dequantize(q4, GGMLQuantizationType.Q4_K).reshape(64, 256),
            gguf_dequantize(q6, GGMLQuantizationType.Q6_K).reshape(32, 256),
        ]
    )
    weight = int8_kernel.dequantize_torch(values, scales, mins, torch.float32)
    assert torch.equal(weight, torch.from_numpy(expected))


def converted(tmp_path: Path, tensor_type: GGMLQuantizationType) -> Path:
    return converted_tiny_gguf(tmp_path, TinyGgufSpec(tensor_type=tensor_type))


@needs_kernel
@pytest.mark.parametrize("tensor_type", TYPES[1:], ids=IDS[1:])
def test_auto_serves_the_files_k_quant_weights(
    tmp_path: Path, tensor_type: GGMLQuantizationType
) -> None:
    model_dir = converted(tmp_path, tensor_type)
    with capture_logs() as logs:
        kept, kept_logits = load(model_dir, "bfloat16", "auto")
    _, bf16_logits = load(model_dir, "bfloat16", "none")
    _, exact_logits = load(model_dir, "float32", "none")

    model = kept.model
    projections = [
        m for m in model.model.layers.modules() if isinstance(m, (Linear, Int8GroupLinear))
    ]
    assert len(projections) == 4 * NUM_LAYERS
    assert all(isinstance(m, Int8GroupLinear) and m.kernel == "pdserve" for m in projections)
    assert isinstance(model.lm_head, Int8GroupLinear)
    assert isinstance(model.model.embed_tokens, Int8GroupEmbedding)
    [line] = [e for e in logs if e["event"] == "int4_kernel"]
    assert line["projections"] == {"int8 (pdserve's kernel)": 4 * NUM_LAYERS}
    assert line["lm_head"] == f"int8 ({tensor_type.name}, pdserve's kernel)"
    [loaded] = [e for e in logs if e["event"] == "model_loaded"]
    assert loaded["tensor_types"] == {"F32": "bfloat16", tensor_type.name: "int8"}
    # the file's values with float32 sums: as close to the exact logits as the bf16 weights
    kept_error = (kept_logits - exact_logits).abs()
    bf16_error = (bf16_logits - exact_logits).abs()
    assert kept_error.max() <= 1.5 * bf16_error.max()
    assert kept_error.mean() <= 1.5 * bf16_error.mean()
