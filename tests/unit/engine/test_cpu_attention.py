"""pdserve's decode attention on the CPU (`pdserve.engine.cpu_attention`): one query token per
sequence over its paged bf16 K/V, read through the block table, against the exact attention
(float64) over the same keys.

On a CPU with AVX512-BF16 the compiled module must be there (`make venv` builds it); elsewhere
these tests skip and `SdpaAttention` gathers the K/V for torch's SDPA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import cpu_attention


def _cpu_has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512_bf16" in cpuinfo.read_text()


pytestmark = pytest.mark.skipif(
    not _cpu_has_avx512_bf16(), reason="the kernel needs AVX512-BF16; SDPA runs here"
)

NUM_BLOCKS, BLOCK_SIZE = 48, 16


def _case(
    num_heads: int, num_kv_heads: int, head_dim: int, lens: list[int], seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k_cache, v_cache, tables, lens): each sequence's blocks scattered over the cache."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=generator).to(torch.bfloat16)
    width = max(-(-n // BLOCK_SIZE) for n in lens)
    tables = torch.stack(
        [torch.randperm(NUM_BLOCKS, generator=generator)[:width] for _ in lens]
    ).to(torch.int32)
    q = torch.randn(len(lens), num_heads, head_dim, generator=generator).to(torch.bfloat16)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def _exact(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The attention in float64 over each sequence's keys (the last `window` of them)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    outs = []
    for i in range(num_seqs):
        num_keys = int(lens[i])
        blocks = tables[i, : -(-num_keys // BLOCK_SIZE)].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:num_keys].double()
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:num_keys].double()
        first = max(0, num_keys - window) if window else 0
        keys, values = keys[first:], values[first:]
        query = q[i].double().view(num_kv_heads, group, head_dim)
        scores = torch.einsum("hgd,thd->hgt", query, keys) * head_dim**-0.5
        if sinks is not None:
            scores = torch.cat([scores, sinks.double().view(num_kv_heads, group, 1)], dim=-1)
        weights = scores.softmax(-1)[..., : num_keys - first]
        outs.append(torch.einsum("hgt,thd->hgd", weights, values).reshape(num_heads, head_dim))
    return torch.stack(outs)


def _check(out: torch.Tensor, exact: torch.Tensor) -> None:
    """float32 sums rounded once to bf16: the exact value rounded, but for values within
    float32's error of a bf16 rounding boundary."""
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    assert (out == exact.to(torch.bfloat16)).float().mean().item() >= 0.99
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()


def test_the_compiled_kernel_is_installed_and_runs_here() -> None:
    assert cpu_attention.available()


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(9, 3, 64), (4, 4, 128), (16, 2, 64), (8, 1, 256), (6, 2, 96)],
)
def test_decode_attention_is_the_exact_attention_rounded_to_bf16(
    num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    lens = [1, 17, 300, 64]
    q, k_cache, v_cache, tables, lens_t = _case(num_heads, num_kv_heads, head_dim, lens)
    assert cpu_attention.takes(q, k_cache, num_kv_heads)
    out = cpu_attention.decode(q, k_cache, v_cache, tables, lens_t, head_dim**-0.5, None, None)
    _check(out, _exact(q, k_cache, v_cache, tables, lens_t))


def test_a_sliding_window_sees_only_its_last_keys() -> None:
    q, k_cache, v_cache, tables, lens = _case(9, 3, 64, [200, 40, 65], seed=1)
    out = cpu_attention.decode(q, k_cache, v_cache, tables, lens, 0.125, 64, None)
    _check(out, _exact(q, k_cache, v_cache, tables, lens, window=64))
    whole = _exact(q, k_cache, v_cache, tables, lens)
    assert not torch.allclose(out[0].double(), whole[0], atol=1e-2)


def test_sink_logits_take_their_share_of_the_softmax() -> None:
    q, k_cache, v_cache, tables, lens = _case(8, 2, 64, [50, 3], seed=2)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2
    out = cpu_attention.decode(q, k_cache, v_cache, tables, lens, 0.125, None, sinks)
    _check(out, _exact(q, k_cache, v_cache, tables, lens, sinks=sinks))


def test_the_kernel_declines_what_it_does_not_take() -> None:
    q, k_cache, _, _, _ = _case(9, 3, 64, [10])
    assert not cpu_attention.takes(q.half(), k_cache.half(), 3)  # no float16 form
    assert not cpu_attention.takes(q.float(), k_cache, 3)  # a float32 query over a bf16 cache
    # NOTE: float32 over a float32 cache has its own form (f32_gemm.cpp's CPUs, AVX2 and up).
    f32_form = cpu_attention.cpu_kernels.f32_available()
    assert cpu_attention.takes(q.float(), k_cache.float(), 3) == f32_form
    assert not cpu_attention.takes(q, k_cache, 1)  # 9 query heads per KV head: more than 8
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert not cpu_attention.takes(q, k_cache, 3)
    finally:
        torch.set_num_threads(previous)
