"""pdserve's int4 CPU kernel (``shared/csrc/int4_gemm.cpp``): a GGUF's int4 groups, ``scale * q
+ min`` in groups of 32, times bfloat16 activations on AVX512-BF16, with the file's scales and
mins as they are.

torch's int4 kernel (``_weight_int4pack_mm_for_cpu``) reads a one-row decode step's int4
weights at under half the machine's read bandwidth and takes its scales in bfloat16 (8 bits of
a scale the file stores in 11). This one widens each byte's two values into bf16 ``128 + q``
and multiplies them with VDPBF16PS (exact products, float32 sums), then applies the group's
float32 (or float16, where that holds them exactly) scale and min: the file's weights exactly,
and each row's result independent of the other rows of the call.

It runs where the CPU has AVX512-BF16 (`available`) and the compiled module was built (it is
optional: without a C++ compiler pdserve installs without it); it is single-threaded, so the
engine uses it where torch runs one thread (``pdserve up`` gives each engine its share of the
cores; on a host with more, torch's kernel runs over its threads).

With a table, the 4-bit values are codes: ``scale * table[q]`` (MXFP4's e2m1 values times
their block's power of two, gpt-oss's experts as released), each code turned into its value by
a lookup in the kernel (`table_of`; the bf16 and the float32 kernel alike), and the mins may
be left out.

With float32 activations (``--dtype auto`` on a CPU without native bf16) the same packed weight
runs on ``f32_gemm.cpp``'s kernel (AVX2, FMA and F16C): each value widened to a float32 integer
and multiplied with FMA, the group's scale and min applied as here; `matmul` and `dequantize`
pick the kernel by the activations' dtype. torch's int4 kernel is 16-40x slower than a float32
GEMM with float32 activations, so without this kernel a float32 engine dequantizes the file.
"""

from __future__ import annotations

import torch

import pdserve.engine.cpu_kernels as cpu_kernels

GROUP = 32
"""Input features per scale and min."""
PAIR = 2 * GROUP
"""Input features per step of the kernel: in_features must be a multiple of it."""

available = cpu_kernels.available
_FIT = cpu_kernels.GemmFit(PAIR)
takes = _FIT.takes
why_not = _FIT.why_not


def table_of(values: tuple[float, ...]) -> torch.Tensor:
    """The 16 values of a code table as the kernel reads them (bfloat16).

    Raises:
        ValueError: Where there are not 16 or one is not exact in bfloat16.
    """
    table = torch.tensor(values, dtype=torch.float32)
    if table.numel() != 16 or not torch.equal(table.bfloat16().float(), table):
        raise ValueError(f"a code table holds 16 values exact in bfloat16, not {values}")
    return table.bfloat16()


def unpack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """4-bit values as a GGUF's int4 tensors hold them (``[..., in / 2]`` uint8, column ``2i``
    in the low nibble, ``2i + 1`` in the high one) as ``[..., in]`` uint8 in 0..15."""
    return torch.stack([values & 0x0F, values >> 4], dim=-1).flatten(-2)


def pack(q: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of ``[out, in]`` values in 0..15: ``[out, in / 2]`` uint8, each pair
    of groups as ``shared/csrc/int4_gemm.cpp`` describes."""
    num_out, num_in = q.shape
    # q6: [out, pair, g, half (column j or 16 + j), t, e]; column = half * 16 + 2t + e
    q6 = q.to(torch.uint8).view(num_out, num_in // PAIR, 2, 2, 8, 2)
    # byte k = 4t + 2g + e: [out, pair, t, g, e, half]
    ordered = q6.permute(0, 1, 4, 2, 5, 3)
    packed = ordered[..., 0] | (ordered[..., 1] << 4)
    return packed.reshape(num_out, num_in // 2).contiguous()


def scale_dtype(scales: torch.Tensor, mins: torch.Tensor) -> torch.dtype:
    """float16 where it holds every scale and min exactly (Q4_0 and Q4_1 store them so), else
    float32."""
    for values in (scales, mins):
        half = values.to(torch.float16)
        if not torch.equal(half.float(), values.float()):
            return torch.float32
    return torch.float16


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    dtype: torch.dtype = torch.bfloat16,
    table: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight ``scale * q + min`` (``scale * table[q] + min`` with a table) as ``[out,
    in]`` `dtype` (bfloat16 or float32; the arguments as `matmul` takes them): in float32 the
    product and the sum each rounded once, the `gguf` package's values."""
    num_out, num_in = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(num_out, num_in, dtype=dtype)
    cpu_kernels.kernel("int4_dequantize", dtype)(
        packed.data_ptr(),
        scales.data_ptr(),
        0 if mins is None else mins.data_ptr(),
        num_out,
        num_in,
        out.data_ptr(),
        scales.dtype == torch.float16,
        *_table_argument(table),
    )
    return out


def matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    table: torch.Tensor | None = None,
    fixed_order: bool = False,
) -> torch.Tensor:
    """``x @ w.T`` for ``w = scale * q + min`` (``scale * table[q] + min`` with a table).

    Args:
        x: ``[rows, in]`` bfloat16 (AVX512-BF16) or float32 (AVX2).
        packed: `pack`'s ``[out, in / 2]``.
        scales: ``[out, in / 32]`` float16 or float32.
        mins: ``[in / 32, out]`` (transposed: the kernel sums each output row's mins times the
            groups' sums of x for 16 output rows at a time), the same dtype; None: no mins.
        table: `table_of`'s 16 bfloat16 values, or None.
        fixed_order: On `pdserve.engine.amx_gemm`'s AMX kernel (where it `takes` the call: bf16,
            no table), whose sums run in one order for any number of rows.

    Returns:
        ``[rows, out]`` in x's dtype.
    """
    x = x.contiguous()
    num_rows, num_in = x.shape
    num_out = packed.shape[0]
    out = torch.empty(num_rows, num_out, dtype=x.dtype)
    if num_rows:
        compiled = cpu_kernels.compiled()
        gemm = compiled.amx_int4_gemm if fixed_order else cpu_kernels.kernel("int4_gemm", x.dtype)
        gemm(
            x.data_ptr(),
            num_rows,
            num_in,
            packed.data_ptr(),
            scales.data_ptr(),
            0 if mins is None else mins.data_ptr(),
            num_out,
            out.data_ptr(),
            scales.dtype == torch.float16,
            *_table_argument(table),
        )
    return out


def _table_argument(table: torch.Tensor | None) -> tuple[int, ...]:
    """The kernel's optional last argument: the table's address, or nothing."""
    if table is None:
        return ()
    if table.dtype != torch.bfloat16 or table.numel() != 16:
        raise ValueError(f"a code table is 16 bfloat16 values, not {table.numel()} {table.dtype}")
    return (table.data_ptr(),)
