"""pdserve's float32 CPU kernels (``shared/csrc/f32_gemm.cpp`` and the float32 forms in
``decode_attention.cpp`` and ``rms_norm.cpp``): a GGUF's int4 and int8 groups times float32
activations, decode attention over a float32 cache and RMSNorm, on AVX2.

``--dtype auto`` is float32 on a CPU without native bf16, and there a GGUF's quantized tensors
are kept as the file stores them on these kernels. Every x86-64 CPU pdserve serves on has AVX2,
FMA and F16C; these tests skip only on one without them (or off x86).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from structlog.testing import capture_logs
from support.converted_gguf import PROMPT, converted_tiny_gguf, prompt_logits
from support.gguf_files import NUM_LAYERS, TinyGgufSpec, random_weight

from pdserve.engine import (
    ScheduledChunk,
    cpu_attention,
    cpu_kernels,
    cpu_norm,
    int4_kernel,
    int8_kernel,
)
from pdserve.engine.gguf_int4 import INT4_TYPES, INT8_TYPES, int4_blocks, int8_blocks
from pdserve.engine.linear import Linear
from pdserve.engine.quant import (
    OWN_KERNEL_MAX_ROWS,
    Int4Linear,
    Int8GroupEmbedding,
    Int8GroupLinear,
)


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


pytestmark = pytest.mark.skipif(
    not {"avx2", "fma", "f16c"} <= _cpu_flags(), reason="the float32 kernels need AVX2, FMA, F16C"
)


@pytest.fixture(autouse=True)
def one_thread() -> object:
    """The kernels run where torch runs one thread (each engine gets its share of the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_float32_kernels_are_installed_and_run_here() -> None:
    assert cpu_kernels.f32_available()
    assert int4_kernel.why_not(torch.float32) is None
    assert int8_kernel.why_not(torch.float32) is None


def _read_out(linear: torch.nn.Module, in_features: int, rows: int) -> torch.Tensor:
    """The [out, in] weight a projection computes with: one-hot rows, `rows` a call."""
    eye = torch.eye(in_features)
    with torch.no_grad():
        return torch.cat([linear(eye[i : i + rows]) for i in range(0, in_features, rows)]).t()


@pytest.mark.parametrize("tensor_type", INT4_TYPES, ids=[t.name for t in INT4_TYPES])
@pytest.mark.parametrize("rows", [1, 3, OWN_KERNEL_MAX_ROWS, 64], ids=lambda r: f"{r}-rows")
def test_int4_one_hot_rows_read_the_files_values(
    tensor_type: GGMLQuantizationType, rows: int
) -> None:
    """On the kernel (up to 8 rows) and over the weight dequantized in float32 (more): ``s * q
    + m`` exactly as the gguf package computes it."""
    raw = random_weight(np.random.default_rng(5), (64, 256), tensor_type)
    expected = torch.from_numpy(gguf_dequantize(raw, tensor_type).reshape(64, 256))
    values, scales, mins = (torch.from_numpy(part) for part in int4_blocks(raw, tensor_type))
    linear = Int4Linear.from_blocks(values, scales, mins, None, torch.float32)
    assert linear.kernel == "pdserve"
    assert torch.equal(_read_out(linear, 256, rows), expected)


@pytest.mark.parametrize("tensor_type", INT8_TYPES, ids=[t.name for t in INT8_TYPES])
@pytest.mark.parametrize("rows", [1, 5, 64], ids=lambda r: f"{r}-rows")
def test_int8_one_hot_rows_read_the_files_values(
    tensor_type: GGMLQuantizationType, rows: int
) -> None:
    raw = random_weight(np.random.default_rng(6), (48, 256), tensor_type)
    expected = torch.from_numpy(gguf_dequantize(raw, tensor_type).reshape(48, 256))
    blocks = int8_blocks(raw, tensor_type)
    mins = None if blocks.mins is None else torch.from_numpy(blocks.mins)
    linear = Int8GroupLinear(
        torch.from_numpy(blocks.values), torch.from_numpy(blocks.scales), torch.float32, mins
    )
    assert linear.kernel == "pdserve"
    assert torch.equal(_read_out(linear, 256, rows), expected)


def _int4_linear(
    out_features: int, in_features: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[Int4Linear, torch.Tensor]:
    """A random int4 projection with float16-exact scales and mins, and its float64 weight."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=generator)
    shape = (out_features, in_features // 32)
    scales = (torch.rand(shape, generator=generator) * 0.02 + 1e-3).half().float()
    mins = (-8 * scales + torch.randn(shape, generator=generator) * 1e-3).half().float()
    groups = q.view(out_features, -1, 32).double()
    weight = (groups * scales.double()[..., None] + mins.double()[..., None]).flatten(1)
    return Int4Linear(q, scales, mins, None, dtype), weight


def test_int4_rows_are_computed_alone_and_close_to_exact() -> None:
    """A row's result does not depend on the rows beside it (1 to 8), and is the exact product
    to float32's rounding of the sums."""
    linear, weight = _int4_linear(200, 576, seed=1)
    assert linear.kernel == "pdserve"
    x = torch.randn(OWN_KERNEL_MAX_ROWS, 576, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
        for rows in range(2, OWN_KERNEL_MAX_ROWS + 1):
            assert torch.equal(linear(x[:rows]), alone[:rows]), f"{rows} rows"
    exact = x.double() @ weight.t()
    torch.testing.assert_close(alone.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())


def test_int8_rows_are_computed_alone() -> None:
    generator = torch.Generator().manual_seed(3)
    values = torch.randint(-128, 128, (100, 512), generator=generator, dtype=torch.int8)
    scales = (torch.rand(100, 32, generator=generator) * 0.01).float()
    mins = torch.randn(100, 32, generator=generator) * 0.01
    linear = Int8GroupLinear(values, scales, torch.float32, mins)
    x = torch.randn(6, 512, generator=generator)
    with torch.no_grad():
        alone = torch.cat([linear(x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(linear(x), alone)
    weight = values.double() * scales.double().repeat_interleave(16, 1)
    weight += mins.double().repeat_interleave(16, 1)
    exact = x.double() @ weight.t()
    torch.testing.assert_close(alone.double(), exact, rtol=0, atol=1e-5 * exact.abs().max().item())


@pytest.fixture
def kernel_team() -> Iterator[Callable[[int, int], None]]:
    """Sets the kernel team (`cpu_kernels.set_team_threads`); one thread again after."""
    yield cpu_kernels.set_team_threads
    cpu_kernels.set_team_threads(1)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                not cpu_kernels.available(), reason="the bf16 kernels need AVX512-BF16"
            ),
        ),
    ],
    ids=["float32", "bfloat16"],
)
@pytest.mark.parametrize("threads", [2, 3])
def test_a_kernel_team_gives_one_threads_bits(
    kernel_team: Callable[[int, int], None], threads: int, dtype: torch.dtype
) -> None:
    """The int4 and int8 GEMMs' output rows shared by 2 or 3 threads (output counts that do
    not split evenly), whichever thread computes a part: every row of 1 to 8 input rows the same
    bits as one thread's; calls of more rows than the team takes run alone. Both sets of
    kernels: float32 activations (AVX2) and bf16 ones (AVX512-BF16)."""
    int4, _ = _int4_linear(200, 576, seed=4, dtype=dtype)
    generator = torch.Generator().manual_seed(5)
    values = torch.randint(-128, 128, (100, 512), generator=generator, dtype=torch.int8)
    scales = (torch.rand(100, 32, generator=generator) * 0.01).float()
    int8 = Int8GroupLinear(values, scales, dtype, torch.randn(100, 32) * 0.01)
    assert int4.kernel == "pdserve" and int8.kernel == "pdserve"
    x4 = torch.randn(OWN_KERNEL_MAX_ROWS, 576, generator=generator).to(dtype)
    x8 = torch.randn(OWN_KERNEL_MAX_ROWS, 512, generator=generator).to(dtype)
    rows = range(1, OWN_KERNEL_MAX_ROWS + 1)
    with torch.no_grad():
        alone = [(int4(x4[:n]), int8(x8[:n])) for n in rows]
        kernel_team(threads, OWN_KERNEL_MAX_ROWS)
        assert cpu_kernels.team_threads() == threads
        for n, (want4, want8) in zip(rows, alone, strict=True):
            assert torch.equal(int4(x4[:n]), want4), f"int4, {n} rows"
            assert torch.equal(int8(x8[:n]), want8), f"int8, {n} rows"
        # NOTE: a team thread claims parts as it gets to run (the caller takes the rest): the
        # calls go on until one did, every result checked.
        shared = cpu_kernels.team_shared_parts()
        deadline = time.monotonic() + 120
        while cpu_kernels.team_shared_parts() == shared and time.monotonic() < deadline:
            for n, (want4, want8) in zip(rows, alone, strict=True):
                assert torch.equal(int4(x4[:n]), want4), f"int4, {n} rows"
                assert torch.equal(int8(x8[:n]), want8), f"int8, {n} rows"
        assert cpu_kernels.team_shared_parts() > shared, "no team thread computed a part"
        kernel_team(threads, 1)
        assert torch.equal(int4(x4[:3]), alone[2][0])


def test_a_child_forked_beside_a_kernel_team_computes_alone(
    kernel_team: Callable[[int, int], None],
) -> None:
    """A process forked while the team has threads has none of them: its one-row GEMMs run on
    its one thread (the same bits) instead of waiting forever for threads that are not there."""
    int4, _ = _int4_linear(200, 576, seed=6)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = int4(x)
        kernel_team(2, 1)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            same = torch.equal(int4(x), want) and cpu_kernels.team_threads() == 1
            os._exit(0 if same else 1)
        status = None
        deadline = time.monotonic() + 60
        while status is None and time.monotonic() < deadline:
            done, code = os.waitpid(pid, os.WNOHANG)
            status = code if done else None
            time.sleep(0.05)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert status == 0, "the forked child hung or computed other values"
        assert cpu_kernels.team_threads() == 2


def test_a_kernel_team_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        cpu_kernels.set_team_threads(0)


def _paged(
    lengths: list[int], num_kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K cache, V cache, block tables, lengths) with each sequence's blocks shuffled."""
    generator = torch.Generator().manual_seed(seed)
    block_size, width = 16, max((n + 15) // 16 for n in lengths)
    num_blocks = sum((n + 15) // 16 for n in lengths) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator)
    v_cache = torch.randn(shape, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for row, length in enumerate(lengths):
        for column in range((length + 15) // 16):
            tables[row, column] = order.pop()
    return k_cache, v_cache, tables, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 20], ids=["full", "window-20"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_decode_attention_over_a_float32_cache(window: int | None, with_sinks: bool) -> None:
    lengths, num_heads, num_kv_heads, head_dim, scale = [37, 5, 120], 9, 3, 64, 0.125
    k_cache, v_cache, tables, lens = _paged(lengths, num_kv_heads, head_dim, seed=4)
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=generator)
    sinks = torch.randn(num_heads, generator=generator) if with_sinks else None
    assert cpu_attention.takes(q, k_cache, num_kv_heads)
    out = cpu_attention.decode(q, k_cache, v_cache, tables, lens, scale, window, sinks)
    group = num_heads // num_kv_heads
    for row, length in enumerate(lengths):
        first = max(0, length - window) if window else 0
        positions = torch.arange(first, length)
        blocks = tables[row, positions // 16].long()
        keys = k_cache[blocks, positions % 16].double().repeat_interleave(group, dim=1)
        values = v_cache[blocks, positions % 16].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[row].double(), keys) * scale
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        weights = scores.softmax(dim=-1)[:, : len(positions)]
        exact = torch.einsum("ht,thd->hd", weights, values)
        torch.testing.assert_close(out[row].double(), exact, rtol=0, atol=1e-5)
        # each sequence alone: the same bits
        single = cpu_attention.decode(
            q[row : row + 1],
            k_cache,
            v_cache,
            tables[row : row + 1],
            lens[row : row + 1],
            scale,
            window,
            sinks,
        )
        assert torch.equal(single[0], out[row])
    # a tensor-parallel rank's cache is a view of its heads in a wider one: not the kernel's
    assert not cpu_attention.takes(q[:, :3], k_cache[:, :, :1], 1)


@pytest.mark.parametrize("size", [576, 70], ids=["576", "70"])
def test_rms_norm_of_float32_rows(size: int) -> None:
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(5, size, generator=generator)
    weight = torch.randn(size, generator=generator)
    assert cpu_norm.takes(x, weight)
    out = cpu_norm.rms_norm(x, weight, 1e-5, False)
    torch.testing.assert_close(out, F.rms_norm(x, (size,), weight, 1e-5), rtol=1e-6, atol=1e-6)
    assert torch.equal(cpu_norm.rms_norm(x[2:3], weight, 1e-5, False)[0], out[2])


@pytest.mark.parametrize(
    "tensor_type", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K], ids=["Q4_1", "Q4_K"]
)
def test_float32_auto_serves_the_files_int4_weights(
    tmp_path: Path, tensor_type: GGMLQuantizationType
) -> None:
    """``--dtype float32`` with ``auto`` quantization keeps a GGUF's int4 weights on the float32
    kernel, says so, and computes what the file dequantized to float32 computes."""
    model_dir = converted_tiny_gguf(tmp_path, TinyGgufSpec(tensor_type=tensor_type))
    with capture_logs() as logs:
        kept, kept_logits = prompt_logits(model_dir, "float32", "auto")
    exact, exact_logits = prompt_logits(model_dir, "float32", "none")
    projections = [
        m for m in kept.model.model.layers.modules() if isinstance(m, (Linear, Int4Linear))
    ]
    assert len(projections) == 4 * NUM_LAYERS
    assert all(isinstance(m, Int4Linear) and m.kernel == "pdserve" for m in projections)
    [line] = [e for e in logs if e["event"] == "int4_kernel"]
    assert line["activations"] == "float32"
    assert line["projections"] == {"int4 (pdserve's kernel)": 4 * NUM_LAYERS}
    [loaded] = [e for e in logs if e["event"] == "model_loaded"]
    assert loaded["tensor_types"][tensor_type.name].startswith("int4")
    # the prompt's rows take a float32 GEMM over the weight dequantized exactly (the file's
    # values, as `none` has them), in another GEMM's order of sums; a decode step's one row
    # runs on the kernels themselves. float32's rounding only, through two random layers (the
    # same file in bf16 is off by 14-24% of the largest logit here).
    atol = 1e-4 * exact_logits.abs().max().item()
    torch.testing.assert_close(kept_logits, exact_logits, rtol=0, atol=atol)
    step = ScheduledChunk([PROMPT[-1]], len(PROMPT), [0, 1, 2])
    torch.testing.assert_close(
        kept.execute([step]).float(), exact.execute([step]).float(), rtol=0, atol=atol
    )


def test_float32_auto_keeps_a_q8_0_model_and_its_tied_head(tmp_path: Path) -> None:
    """Q8_0 projections, and the LM head with the embedding reading the same tensors, on the
    float32 int8 kernel: the file's values, as the file dequantized to float32 computes."""
    spec = TinyGgufSpec(tensor_type=GGMLQuantizationType.Q8_0, tie_word_embeddings=True)
    model_dir = converted_tiny_gguf(tmp_path, spec)
    with capture_logs() as logs:
        kept, kept_logits = prompt_logits(model_dir, "float32", "auto")
    exact, exact_logits = prompt_logits(model_dir, "float32", "none")
    head = kept.model.lm_head
    assert isinstance(head, Int8GroupLinear) and head.kernel == "pdserve"
    assert isinstance(kept.model.model.embed_tokens, Int8GroupEmbedding)
    assert kept.model.model.embed_tokens.values is head.values
    [line] = [e for e in logs if e["event"] == "int4_kernel"]
    assert line["lm_head"] == "int8 (Q8_0, pdserve's kernel)"
    [loaded] = [e for e in logs if e["event"] == "model_loaded"]
    assert loaded["tensor_types"]["Q8_0"] == "int8"
    atol = 1e-4 * exact_logits.abs().max().item()
    torch.testing.assert_close(kept_logits, exact_logits, rtol=0, atol=atol)
    step = ScheduledChunk([PROMPT[-1]], len(PROMPT), [0, 1, 2])
    torch.testing.assert_close(
        kept.execute([step]).float(), exact.execute([step]).float(), rtol=0, atol=atol
    )
