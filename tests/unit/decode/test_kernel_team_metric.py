"""The decode's ``pdserve_decode_kernel_team_parts`` counter: the parts of one-row GEMMs the
kernel team's threads computed, read from the kernels at each scrape."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.decode.metrics import DecodeMetrics
from pdserve.engine import cpu_kernels
from pdserve.engine.quant import Int8GroupLinear

pytestmark = pytest.mark.skipif(
    not cpu_kernels.f32_available(), reason="the kernel team runs the float32 kernels"
)


@pytest.fixture
def team_of_two() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu_kernels.set_team_threads(2)
    yield
    cpu_kernels.set_team_threads(1)
    torch.set_num_threads(threads)


def test_the_decode_counts_the_parts_its_kernel_team_computed(team_of_two: None) -> None:
    registry = DecodeMetrics().registry
    before = registry.get_sample_value("pdserve_decode_kernel_team_parts_total")
    assert before == cpu_kernels.team_shared_parts()
    generator = torch.Generator().manual_seed(3)
    values = torch.randint(-128, 128, (256, 512), generator=generator, dtype=torch.int8)
    scales = (torch.rand(256, 16, generator=generator) * 0.01).float()
    linear = Int8GroupLinear(values, scales, torch.float32, torch.randn(256, 16) * 0.01)
    x = torch.randn(1, 512, generator=generator)
    # NOTE: a team thread claims parts as it gets to run: the calls go on until one did.
    deadline = time.monotonic() + 120
    with torch.no_grad():
        while cpu_kernels.team_shared_parts() == before and time.monotonic() < deadline:
            linear(x)
    after = registry.get_sample_value("pdserve_decode_kernel_team_parts_total")
    assert after is not None and before is not None and after > before
