"""A GGUF's Q8_0 LM head kept as the file stores it: pdserve's int8 kernel
(`pdserve.engine.int8_kernel`), its torch fallback, the embedding over the same tensors, and a
tiny model loaded with them.

The kernel needs AVX512-BF16 and the compiled module (`make venv` builds it); where the CPU
lacks it those tests skip, and the fallback (a GEMM over the weight dequantized in torch's ops)
is tested everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from safetensors import safe_open
from structlog.testing import capture_logs
from support.converted_gguf import PROMPT, converted_tiny_gguf
from support.converted_gguf import prompt_logits as load
from support.gguf_files import (
    HIDDEN_SIZE,
    NUM_LAYERS,
    TinyGgufSpec,
    random_weight,
)

from pdserve.engine import cpu_kernels, int8_kernel
from pdserve.engine.gguf_int4 import (
    INT4_FILE,
    INT8,
    SCALES,
    TYPES_KEY,
    dequantize_int8,
    int8_blocks,
)
from pdserve.engine.linear import Linear
from pdserve.engine.quant import (
    INT8_GROUP_CHUNK,
    OWN_KERNEL_MAX_ROWS,
    Int8GroupEmbedding,
    Int8GroupLinear,
    weight_bytes,
)

Q8_0 = GGMLQuantizationType.Q8_0


def _cpu_has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512_bf16" in cpuinfo.read_text()


needs_kernel = pytest.mark.skipif(
    not _cpu_has_avx512_bf16(), reason="the kernel needs AVX512-BF16; the fallback runs here"
)


def file_weight(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 values, float16 scales, the gguf package's float32 weight) of a random Q8_0
    weight."""
    raw = random_weight(np.random.default_rng(seed), (rows, cols), Q8_0)
    expected = gguf_dequantize(raw, Q8_0).reshape(rows, cols)
    values, scales, _ = int8_blocks(raw, Q8_0)
    return torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(expected)


def head(values: torch.Tensor, scales: torch.Tensor, kernel: str) -> Int8GroupLinear:
    """An `Int8GroupLinear` on `kernel` (``pdserve`` or ``torch``, the fallback)."""
    linear = Int8GroupLinear(values, scales, torch.bfloat16)
    if kernel == "torch":
        linear.kernel = "torch"
    assert linear.kernel == kernel
    return linear


def kernels() -> list[Any]:
    return [pytest.param("pdserve", marks=needs_kernel), "torch"]


@needs_kernel
def test_the_compiled_kernel_is_installed_and_runs_here() -> None:
    assert int8_kernel.why_not(torch.bfloat16) is None
    assert int8_kernel.available()


def test_blocks_hold_the_files_values() -> None:
    raw = random_weight(np.random.default_rng(0), (64, 256), Q8_0)
    expected = gguf_dequantize(raw, Q8_0).reshape(64, 256)
    blocks = int8_blocks(raw, Q8_0)
    assert blocks.values.dtype == np.int8 and blocks.scales.dtype == np.float16
    assert np.array_equal(dequantize_int8(blocks).view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("kernel", kernels())
def test_one_hot_rows_read_the_files_values(kernel: str) -> None:
    """Each weight read out by a one-hot row: the gguf package's float32 value, rounded to bf16
    (both ways: up to `OWN_KERNEL_MAX_ROWS` rows and more)."""
    values, scales, expected = file_weight(200, 256, seed=1)
    linear = head(values, scales, kernel)
    eye = torch.eye(256, dtype=torch.bfloat16)
    with torch.no_grad():
        few = torch.cat([linear(eye[i : i + OWN_KERNEL_MAX_ROWS]) for i in range(0, 256, 8)])
        many = linear(eye)
    assert torch.equal(few.t(), expected.to(torch.bfloat16))
    assert torch.equal(many.t(), expected.to(torch.bfloat16))


@pytest.mark.parametrize("kernel", kernels())
def test_the_embedding_reads_the_files_rows(kernel: str) -> None:
    values, scales, expected = file_weight(300, 256, seed=2)
    embedding = Int8GroupEmbedding(values, scales, torch.bfloat16)
    embedding.kernel = kernel
    ids = torch.tensor([[5, 0], [299, 5]])
    rows = embedding(ids)
    assert rows.shape == (2, 2, 256) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, expected.to(torch.bfloat16)[ids])
    with pytest.raises(IndexError):
        embedding(torch.tensor([300]))


@needs_kernel
@pytest.mark.parametrize("shape", [(64, 64), (960, 576), (1000, 1536)])
def test_the_product_is_the_exact_one_rounded_to_bf16(shape: tuple[int, int]) -> None:
    values, scales, weight = file_weight(*shape, seed=3)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    exact = x.double() @ weight.double().t()
    out = int8_kernel.matmul(x, values, scales)
    assert out.dtype == torch.bfloat16 and out.shape == (5, shape[0])
    # NOTE: float32 sums then one rounding to bf16: equal to the exact product rounded, but
    # where the exact value lies within float32's error of a bf16 rounding boundary.
    equal = (out == exact.to(torch.bfloat16)).float().mean().item()
    assert equal >= 0.99, equal
    # half a bf16 step of the result, and float32's error of sums of terms up to 256 |x| d
    bound = exact.abs() * 2**-8 + 2**-14 * (x.double().abs() @ weight.double().abs().t())
    assert ((out.double() - exact).abs() <= bound).all()


@needs_kernel
def test_the_kernel_and_the_fallback_agree() -> None:
    """Both within their roundings of the exact product (torch's bf16 GEMM rounds more than
    once: it equals the exact product rounded in about 58% of the outputs here, the kernel in
    all but a few)."""
    values, scales, weight = file_weight(1000, 576, seed=5)
    x = torch.randn(32, 576, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    exact = x.double() @ weight.double().t()
    own, fallback = head(values, scales, "pdserve"), head(values, scales, "torch")
    with torch.no_grad():
        for rows in (1, 3, 8, 32):
            ours, theirs = own(x[:rows]).double(), fallback(x[:rows]).double()
            bound = exact[:rows].abs() * 2**-7 + 2**-12 * (
                x[:rows].double().abs() @ weight.double().abs().t()
            )
            assert ((ours - theirs).abs() <= 2 * bound).all(), rows
            if rows <= OWN_KERNEL_MAX_ROWS:
                equal = (ours == exact[:rows].to(torch.bfloat16).double()).float().mean()
                assert equal >= 0.99, (rows, equal)
            else:
                assert torch.equal(ours, theirs)  # more rows take the same dequantized GEMM


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_beside_any_number_of_rows() -> None:
    values, scales, _ = file_weight(250, 576, seed=7)
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    whole = int8_kernel.matmul(x, values, scales)
    for rows in range(1, 17):
        assert torch.equal(int8_kernel.matmul(x[:rows], values, scales), whole[:rows]), rows
        alone = int8_kernel.matmul(x[rows : rows + 1], values, scales)[0]
        assert torch.equal(alone, whole[rows]), rows
    # NOTE: batch-invariant use (min_rows above one) keeps every row count on the kernel.
    linear = head(values, scales, "pdserve")
    linear.min_rows = 2
    with torch.no_grad():
        assert torch.equal(linear(x), whole)


def test_many_rows_are_dequantized_a_chunk_at_a_time() -> None:
    """More output rows than one chunk: the same as one GEMM over the whole weight."""
    rows = INT8_GROUP_CHUNK + 100
    values, scales, weight = file_weight(rows, 64, seed=9)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    fallback = head(values, scales, "torch")
    with torch.no_grad():
        out = fallback(x)
    expected = torch.nn.functional.linear(x, weight.to(torch.bfloat16))
    torch.testing.assert_close(out.float(), expected.float(), atol=0.02, rtol=0.01)


def converted(tmp_path: Path, tie_word_embeddings: bool) -> Path:
    spec = TinyGgufSpec(tensor_type=Q8_0, tie_word_embeddings=tie_word_embeddings)
    return converted_tiny_gguf(tmp_path, spec)


def test_the_converted_directory_keeps_the_q8_0_embedding(tmp_path: Path) -> None:
    model_dir = converted(tmp_path, tie_word_embeddings=True)
    name = "model.embed_tokens.weight"
    with safe_open(str(model_dir / INT4_FILE), framework="pt") as reader:
        types = json.loads(reader.metadata()[TYPES_KEY])
        values, scales = reader.get_tensor(name + INT8), reader.get_tensor(name + SCALES)
    # every Q8_0 tensor: the embedding and each layer's seven projections
    assert types == dict.fromkeys(types, "Q8_0") and len(types) == 1 + 7 * NUM_LAYERS
    assert name in types
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as reader:
        floats = reader.get_tensor(name)
    assert values.dtype == torch.int8 and scales.dtype == torch.float16
    assert values.shape == floats.shape and scales.shape == (floats.shape[0], HIDDEN_SIZE // 32)
    assert torch.equal(values.float() * scales.float().repeat_interleave(32, dim=1), floats)


@needs_kernel
@pytest.mark.parametrize("tie_word_embeddings", [True, False], ids=["tied", "untied"])
def test_auto_serves_the_files_q8_0_lm_head(tmp_path: Path, tie_word_embeddings: bool) -> None:
    model_dir = converted(tmp_path, tie_word_embeddings)
    with capture_logs() as logs:
        kept, kept_logits = load(model_dir, "bfloat16", "auto")
    bf16, bf16_logits = load(model_dir, "bfloat16", "none")
    _, exact_logits = load(model_dir, "float32", "none")

    model = kept.model
    assert isinstance(model.lm_head, Int8GroupLinear) and model.lm_head.kernel == "pdserve"
    embedding = model.model.embed_tokens
    assert isinstance(embedding, Int8GroupEmbedding)
    # tied: one copy of the int8 tensors, read by both
    is_shared = embedding.values.data_ptr() == model.lm_head.values.data_ptr()
    assert is_shared == tie_word_embeddings
    [line] = [e for e in logs if e["event"] == "int4_kernel"]
    assert line["lm_head"] == "int8 (Q8_0, pdserve's kernel)"
    [loaded] = [e for e in logs if e["event"] == "model_loaded"]
    assert loaded["tensor_types"] == {"F32": "bfloat16", "Q8_0": "int8"}
    layers = model.model.layers
    projections = [m for m in layers.modules() if isinstance(m, (Linear, Int8GroupLinear))]
    assert len(projections) == 4 * NUM_LAYERS
    assert all(isinstance(m, Int8GroupLinear) and m.kernel == "pdserve" for m in projections)
    assert line["projections"] == {"int8 (pdserve's kernel)": 4 * NUM_LAYERS}
    assert weight_bytes(model) < weight_bytes(bf16.model)
    ids = torch.tensor(PROMPT)
    assert torch.equal(model.model.embed_tokens(ids), bf16.model.model.embed_tokens(ids))

    # the file's values with float32 sums, each output rounded once to bf16: as close to the
    # file's exact values (float32) as the same file dequantized to bf16
    kept_error = (kept_logits - exact_logits).abs()
    bf16_error = (bf16_logits - exact_logits).abs()
    assert kept_error.max() <= 1.5 * bf16_error.max()
    assert kept_error.mean() <= 1.5 * bf16_error.mean()


def test_the_lm_head_stays_bf16_where_the_kernel_does_not_run(tmp_path: Path) -> None:
    model_dir = converted(tmp_path, tie_word_embeddings=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with capture_logs() as logs:
            runner, logits = load(model_dir, "bfloat16", "auto")
    finally:
        torch.set_num_threads(previous)
    _, bf16_logits = load(model_dir, "bfloat16", "none")
    assert isinstance(runner.model.lm_head, Linear)
    [line] = [e for e in logs if e["event"] == "int4_kernel"]
    assert line["lm_head"].startswith("bfloat16 (Q8_0 dequantized: ")
    [loaded] = [e for e in logs if e["event"] == "model_loaded"]
    assert loaded["tensor_types"] == {"F32": "bfloat16", "Q8_0": "bfloat16"}
    torch.testing.assert_close(logits, bf16_logits, atol=0.1, rtol=0.02)


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", "auto"), ("bfloat16", "none")])
def test_none_and_float32_without_its_kernel_dequantize_the_q8_0_lm_head(
    tmp_path: Path, dtype: str, quantization: str
) -> None:
    """(float32 ``auto`` keeps it where pdserve's float32 kernels run: `test_f32_kernels`.)"""
    model_dir = converted(tmp_path, tie_word_embeddings=True)
    with (
        capture_logs() as logs,
        mock.patch.object(cpu_kernels, "f32_available", return_value=False),
    ):
        runner, _ = load(model_dir, dtype, quantization)
    assert isinstance(runner.model.lm_head, Linear)
    assert not any(e["event"] == "int4_kernel" for e in logs)
    [loaded] = [e for e in logs if e["event"] == "model_loaded"]
    assert loaded["tensor_types"] == {"F32": dtype, "Q8_0": dtype}
