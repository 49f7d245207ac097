"""pdserve's AMX int4 GEMM (`pdserve.engine.amx_gemm`): every output element summed in one
order, so a row's bits do not depend on the rows beside it or on how many there are; under
``--deterministic`` it runs every call of an int4 projection where the CPU has AMX.

On a CPU with AMX-TILE and AMX-BF16 (and AVX512-BF16) the kernel must run (`make venv` builds
it); elsewhere these tests skip and the int4 kernel keeps running every row count.
"""

from __future__ import annotations

import pytest
import torch
from support.int4_blocks import random_int4_blocks

from pdserve.engine import amx_gemm, int4_kernel
from pdserve.engine.batch_invariant import MIN_ROWS, make_batch_invariant
from pdserve.engine.precision import cpu_flags
from pdserve.engine.quant import Int4Linear

pytestmark = pytest.mark.skipif(
    not {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags(),
    reason="the kernel needs AMX-TILE, AMX-BF16 and AVX512-BF16",
)


def _linear(out_features: int, in_features: int, seed: int, half: bool = False) -> Int4Linear:
    q, scales, mins = random_int4_blocks(out_features, in_features, seed, half)
    linear = Int4Linear(q, scales, mins, None, torch.bfloat16)
    assert linear.kernel == "pdserve"
    return linear


def _fixed(linear: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    assert linear.scales is not None
    return int4_kernel.matmul(x, linear.packed, linear.scales, linear.mins, fixed_order=True)


def test_the_kernel_runs_here() -> None:
    assert amx_gemm.available()
    assert amx_gemm.takes(96, 128, torch.bfloat16)
    assert not amx_gemm.takes(96, 128, torch.float32)
    assert not amx_gemm.takes(80, 128, torch.bfloat16)  # out not a multiple of 32


@pytest.mark.parametrize("half", [False, True], ids=["f32-scales", "f16-scales"])
@pytest.mark.parametrize(("out_features", "in_features"), [(96, 128), (64, 576)])
def test_it_multiplies_by_the_dequantized_weight(
    out_features: int, in_features: int, half: bool
) -> None:
    linear = _linear(out_features, in_features, seed=1, half=half)
    assert linear.scales is not None
    weight = int4_kernel.dequantize(linear.packed, linear.scales, linear.mins, torch.bfloat16)
    x = torch.randn(37, in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = int4_kernel.matmul(x, linear.packed, linear.scales, linear.mins, fixed_order=True)
    expected = x.double() @ weight.double().t()
    assert out.shape == (37, out_features) and out.dtype == torch.bfloat16
    # float32 sums of exact bf16 products, rounded once to bf16
    torch.testing.assert_close(out.double(), expected, rtol=8e-3, atol=1e-3)


def test_a_rows_bits_do_not_depend_on_the_call() -> None:
    """The same row alone, among 1 to 100 others and anywhere among them: the same bits."""
    linear = _linear(96, 128, seed=3)
    assert linear.scales is not None
    generator = torch.Generator().manual_seed(4)
    rows = torch.randn(100, 128, generator=generator).bfloat16()
    alone = torch.cat([_fixed(linear, row[None]) for row in rows])
    for num_rows in (2, 7, 31, 32, 33, 64, 100):
        picked = torch.randint(0, 100, (num_rows,), generator=generator)
        x = torch.randn(num_rows, 128, generator=generator).bfloat16()
        keep = torch.rand(num_rows, generator=generator) < 0.6
        x[keep] = rows[picked[keep]]
        out = int4_kernel.matmul(x, linear.packed, linear.scales, linear.mins, fixed_order=True)
        assert torch.equal(out[keep], alone[picked[keep]]), num_rows


def test_a_deterministic_int4_projection_runs_on_it_for_every_row_count() -> None:
    linear = _linear(96, 128, seed=5)
    linear.bias = torch.nn.Parameter(torch.randn(96).bfloat16(), requires_grad=False)
    assert make_batch_invariant(linear) == (1, 1)
    assert linear.min_rows == MIN_ROWS and linear.is_fixed_order
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    together = linear(x)
    one_by_one = torch.cat([linear(row[None]) for row in x])
    assert torch.equal(together, one_by_one)
    assert linear.scales is not None
    plain = int4_kernel.matmul(x, linear.packed, linear.scales, linear.mins, fixed_order=True)
    assert torch.equal(together, plain + linear.bias)
