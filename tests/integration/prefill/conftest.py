"""Fixtures of the prefill suite: a reference engine and a one-decode cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.prefill_cluster import Cluster, cluster, reference_engine

from pdserve.engine.colocated import LLMEngine


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return reference_engine(tiny_model_dir)


@pytest.fixture
async def pd(tiny_model_dir: Path) -> AsyncIterator[Cluster]:
    """One prefill (token budget 16, block size 4) and one decode."""
    async with cluster(tiny_model_dir) as running:
        yield running
