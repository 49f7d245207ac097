"""The kernel team `pdserve up` gives its decodes: every core on the float32 kernels, none on
the bf16 ones (where one thread reads the weights near the memory's speed)."""

from __future__ import annotations

from pdserve.launcher.cluster import decode_team_args

AVX2 = frozenset({"avx2", "fma", "f16c"})
BF16 = AVX2 | {"avx512f", "avx512_bf16"}


def test_a_float32_host_shares_its_cores_among_the_decodes() -> None:
    assert decode_team_args(1, 2, AVX2) == ["--kernel-threads", "2"]
    assert decode_team_args(2, 8, AVX2) == ["--kernel-threads", "4"]
    assert decode_team_args(3, 2, AVX2) == ["--kernel-threads", "1"]


def test_a_bf16_host_starts_its_decodes_on_one_thread() -> None:
    assert decode_team_args(1, 2, BF16) == []
    assert decode_team_args(2, 64, BF16 | {"amx_bf16"}) == []
