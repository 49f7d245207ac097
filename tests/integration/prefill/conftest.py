"""Fixtures of the prefill suite: a reference engine, a one-decode cluster, the prefill's spans."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.prefill_cluster import Cluster, cluster, reference_engine

from pdserve.common import telemetry
from pdserve.engine.colocated import LLMEngine
from pdserve.prefill import chunk_spans, handoff


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return reference_engine(tiny_model_dir)


@pytest.fixture
async def pd(tiny_model_dir: Path) -> AsyncIterator[Cluster]:
    """One prefill (token budget 16, block size 4) and one decode."""
    async with cluster(tiny_model_dir) as running:
        yield running


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """The prefill's own spans, recorded by a provider of this test alone."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("pdserve.prefill")
    monkeypatch.setattr(handoff, "_tracer", tracer)
    monkeypatch.setattr(chunk_spans, "_tracer", tracer)
    monkeypatch.setattr(telemetry, "_provider", provider)
    yield exporter
    provider.shutdown()
