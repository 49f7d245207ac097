"""pdserve's int4 CPU kernel (`pdserve.engine.int4_kernel`): a GGUF's int4 groups times bf16
activations with the file's own scales and mins, each row alone.

On a CPU with AVX512-BF16 the compiled module must be there (`make venv` builds it); elsewhere
these tests skip, and `Int4Linear` runs torch's kernel (the last test checks that path here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from support.gguf_files import random_weight
from support.int4_blocks import random_int4_blocks

from pdserve.engine import int4_kernel
from pdserve.engine.gguf_int4 import INT4_TYPES, int4_blocks
from pdserve.engine.packed_weights import E2M1_VALUES
from pdserve.engine.quant import OWN_KERNEL_MAX_ROWS, Int4Linear


def _cpu_has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512_bf16" in cpuinfo.read_text()


pytestmark = pytest.mark.skipif(
    not _cpu_has_avx512_bf16(), reason="the kernel needs AVX512-BF16; torch's kernel runs here"
)


def test_the_compiled_kernel_is_installed_and_runs_here() -> None:
    assert int4_kernel.why_not(torch.bfloat16) is None
    assert int4_kernel.available()


def _weight(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    num_out, num_in = q.shape
    groups = q.view(num_out, num_in // 32, 32).double()
    return (groups * scales.double()[..., None] + mins.double()[..., None]).view(num_out, num_in)


def _matmul(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> torch.Tensor:
    dtype = int4_kernel.scale_dtype(scales, mins)
    return int4_kernel.matmul(
        x, int4_kernel.pack(q), scales.to(dtype), mins.t().contiguous().to(dtype)
    )


@pytest.mark.parametrize("tensor_type", INT4_TYPES, ids=[t.name for t in INT4_TYPES])
def test_the_kernel_computes_with_the_files_values(tensor_type: GGMLQuantizationType) -> None:
    """One-hot rows read each weight out: the gguf package's float32 value, rounded to bf16."""
    raw = random_weight(np.random.default_rng(3), (64, 256), tensor_type)
    expected = torch.from_numpy(gguf_dequantize(raw, tensor_type).reshape(64, 256))
    values, scales, mins = (torch.from_numpy(part) for part in int4_blocks(raw, tensor_type))
    linear = Int4Linear.from_blocks(values, scales, mins, None, torch.bfloat16)
    assert linear.kernel == "pdserve"
    eye = torch.eye(256, dtype=torch.bfloat16)
    with torch.no_grad():
        read = torch.cat([linear(eye[i : i + OWN_KERNEL_MAX_ROWS]) for i in range(0, 256, 8)])
    assert torch.equal(read.t(), expected.to(torch.bfloat16))


def test_scales_stay_float16_only_where_that_holds_them_exactly() -> None:
    _, scales, mins = random_int4_blocks(16, 64, seed=0, half=True)
    assert int4_kernel.scale_dtype(scales, mins) == torch.float16
    _, scales, mins = random_int4_blocks(16, 64, seed=0, half=False)
    assert int4_kernel.scale_dtype(scales, mins) == torch.float32


@pytest.mark.parametrize("half", [True, False], ids=["float16_scales", "float32_scales"])
@pytest.mark.parametrize("shape", [(64, 64), (960, 576), (576, 1536)])
def test_the_product_is_the_exact_one_rounded_to_bf16(half: bool, shape: tuple[int, int]) -> None:
    q, scales, mins = random_int4_blocks(*shape, seed=1, half=half)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    weight = _weight(q, scales, mins)
    exact = x.double() @ weight.t()
    out = _matmul(x, q, scales, mins)
    assert out.dtype == torch.bfloat16 and out.shape == (5, shape[0])
    # NOTE: float32 sums then one rounding to bf16: equal to the exact product rounded, but
    # where the exact value lies within float32's error of a bf16 rounding boundary.
    equal = (out == exact.to(torch.bfloat16)).float().mean().item()
    assert equal >= 0.99, equal
    # half a bf16 step of the result, and float32's error of the sums over the terms' sizes
    bound = exact.abs() * 2**-8 + 2**-20 * (x.double().abs() @ weight.abs().t())
    assert ((out.double() - exact).abs() <= bound).all()


def test_a_row_gets_the_same_bits_alone_and_beside_any_number_of_rows() -> None:
    q, scales, mins = random_int4_blocks(96, 576, seed=4, half=True)
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    whole = _matmul(x, q, scales, mins)
    for rows in range(1, 17):
        assert torch.equal(_matmul(x[:rows], q, scales, mins), whole[:rows]), rows
        assert torch.equal(_matmul(x[rows : rows + 1], q, scales, mins)[0], whole[rows]), rows


def test_many_rows_take_a_bf16_gemm_over_the_dequantized_weight() -> None:
    q, scales, mins = random_int4_blocks(64, 128, seed=6, half=True)
    packed = int4_kernel.pack(q)
    dequantized = int4_kernel.dequantize(packed, scales.half(), mins.t().contiguous().half())
    assert torch.equal(dequantized, _weight(q, scales, mins).float().to(torch.bfloat16))
    linear = Int4Linear(q, scales, mins, None, torch.bfloat16)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    exact = x.double() @ _weight(q, scales, mins).t()
    with torch.no_grad():
        out = linear(x)
    torch.testing.assert_close(out.double(), exact, atol=0.02, rtol=0.02)
    # NOTE: batch-invariant use (min_rows above one) keeps every row on the int4 kernel.
    linear.min_rows = 2
    with torch.no_grad():
        assert torch.equal(linear(x), _matmul(x, q, scales, mins))


def _mxfp4(
    out_features: int, in_features: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [out, in] in 0..15, their powers-of-two scales [out, in / 32] float32, the
    weight in float64)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    exponents = torch.randint(-12, 3, (out_features, in_features // 32), generator=generator)
    scales = torch.exp2(exponents.float())
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes]
    weight = values * scales.double().repeat_interleave(32, dim=-1)
    return codes.to(torch.uint8), scales, weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("half", [True, False], ids=["float16_scales", "float32_scales"])
def test_codes_through_a_table_give_the_exact_product_rounded(
    half: bool, dtype: torch.dtype
) -> None:
    """MXFP4's e2m1 codes (gpt-oss's experts) on the same kernels, bf16 and float32: each
    weight the table's value times its block's scale, no mins."""
    codes, scales, weight = _mxfp4(320, 2880, seed=8)
    table = int4_kernel.table_of(E2M1_VALUES)
    packed = int4_kernel.pack(codes)
    scales = scales.half() if half else scales
    x = torch.randn(17, 2880, generator=torch.Generator().manual_seed(9)).to(dtype)
    exact = x.double() @ weight.t()
    out = int4_kernel.matmul(x, packed, scales, None, table)
    assert out.dtype == dtype
    if dtype == torch.bfloat16:
        equal = (out == exact.to(torch.bfloat16)).float().mean().item()
        assert equal >= 0.99, equal
    # NOTE: half a bf16 step of the result (none in float32), and float32's error of the sums
    step = 2**-8 if dtype == torch.bfloat16 else 0
    bound = exact.abs() * step + 2**-20 * (x.double().abs() @ weight.abs().t())
    assert ((out.double() - exact).abs() <= bound).all()
    for rows in (1, 2, 3, 4, 5, 16):  # NOTE: each row alone: its bits whatever the rows beside it
        assert torch.equal(int4_kernel.matmul(x[:rows], packed, scales, None, table), out[:rows])
    dequantized = int4_kernel.dequantize(packed, scales, None, dtype, table)
    assert torch.equal(dequantized.double(), weight)


def test_a_code_table_holds_sixteen_values_exact_in_bf16() -> None:
    with pytest.raises(ValueError, match="16 values exact in bfloat16"):
        int4_kernel.table_of((0.1,) * 16)
    with pytest.raises(ValueError, match="16 values"):
        int4_kernel.table_of(E2M1_VALUES[:8])
    codes, scales, _ = _mxfp4(16, 64, seed=10)
    with pytest.raises(ValueError, match="16 bfloat16 values"):
        int4_kernel.matmul(
            torch.ones(1, 64), int4_kernel.pack(codes), scales, None, torch.tensor(E2M1_VALUES)
        )


def test_torch_kernel_runs_where_torch_has_more_threads() -> None:
    q, scales, mins = random_int4_blocks(64, 128, seed=8, half=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        fallback = Int4Linear(q, scales, mins, None, torch.bfloat16)
        assert int4_kernel.why_not(torch.bfloat16) == "torch runs 2 threads (the kernel runs one)"
    finally:
        torch.set_num_threads(previous)
    own = Int4Linear(q, scales, mins, None, torch.bfloat16)
    assert (fallback.kernel, own.kernel) == ("torch", "pdserve")
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(fallback(x).float(), own(x).float(), atol=0.05, rtol=0.02)
