"""An orchestrator over in-memory instances: a real registry, router and `Orchestrator`
wired to a `MemoryBackend`, for tests of orchestration alone (retries, reschedules, dedupe by
completion index, cleanup calls). Nothing binds a port; the registry's clock moves only when a
test says so (`MemoryCluster.lose`)."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from pdserve.common.generation import SamplingParams, resolve_seed
from pdserve.gateway.active_request import ActiveRequest
from pdserve.gateway.decisions import RetryPolicy
from pdserve.gateway.fleet.instance import InstanceRole, LoadReport
from pdserve.gateway.fleet.registry import Registry
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.orchestrator import Orchestrator, OrchestratorEvent
from pdserve.gateway.phases import TtftTimeline
from pdserve.gateway.request import GenerationEnd, GenerationRequest, TokenChunk
from pdserve.gateway.routing.queue_bounds import QueueLimits
from pdserve.gateway.routing.router import Router
from support.gateway_cluster import instance_info
from support.gateway_fakes import EOS_TOKEN_ID, MODEL_NAME, expected_tokens
from support.memory_backend import MemoryBackend, MemoryInstance

TTL_S = 10.0
PROMPT_IDS = tuple(b"the quick brown fox")


class ManualClock:
    """The registry's clock: stands still until a test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Completion:
    """What a consumer of `Orchestrator.run` received."""

    chunks: list[TokenChunk]
    end: GenerationEnd

    @property
    def token_ids(self) -> list[int]:
        """The tokens in order; checks that every completion index came exactly once."""
        token_ids: list[int] = []
        for chunk in self.chunks:
            assert chunk.first_index == len(token_ids), "a chunk repeats or skips indices"
            token_ids += chunk.token_ids
        return token_ids


class MemoryCluster:
    """A real registry, router and orchestrator over a `MemoryBackend`: no servers, no ports.

    Args:
        queue_limits: The admission queue's bounds (its defaults when None).
        policy: `RetryPolicy` settings.
    """

    def __init__(self, queue_limits: QueueLimits | None = None, **policy: Any) -> None:
        self.clock = ManualClock()
        self.registry = Registry(TTL_S, clock=self.clock)
        self.router = Router(self.registry, rng=random.Random(0))
        self.metrics = GatewayMetrics()
        self.backend = MemoryBackend()
        self.orchestrator = Orchestrator(
            self.backend,
            self.router,
            self.registry,
            RetryPolicy(**policy),
            self.metrics,
            queue_limits=queue_limits,
        )
        self._request_ids = itertools.count()

    def _add(self, instance_id: str, role: InstanceRole, load: LoadReport) -> MemoryInstance:
        info = instance_info(instance_id, role)
        instance = self.backend.instances[info.address] = MemoryInstance(info, load)
        self.registry.register(info, load)
        return instance

    def add_prefill(
        self, instance_id: str = "prefill-0", *, num_queued_prompt_tokens: int = 0
    ) -> MemoryInstance:
        """A prefill (a shorter queue: preferred by the router)."""
        load = LoadReport(num_queued_prompt_tokens=num_queued_prompt_tokens)
        return self._add(instance_id, InstanceRole.PREFILL, load)

    def add_decode(
        self, instance_id: str = "decode-0", *, num_blocks: int = 1000
    ) -> MemoryInstance:
        """A decode (more free blocks: preferred by the router)."""
        load = LoadReport(num_free_blocks=num_blocks, num_total_blocks=num_blocks)
        return self._add(instance_id, InstanceRole.DECODE, load)

    def report(self) -> None:
        """Every instance sends a load report (the same load as before)."""
        for entry in self.registry.entries():
            self.registry.heartbeat(entry.instance_id, entry.load)

    def lose(self, instance: MemoryInstance) -> None:
        """`instance` stops heartbeating; the registry's sweep announces it lost."""
        self.clock.now += TTL_S + 1
        for entry in self.registry.entries():
            if entry.instance_id != instance.instance_id:
                self.registry.heartbeat(entry.instance_id, entry.load)
        self.registry.drop_expired()

    def request(
        self,
        *,
        seed: int = 7,
        max_tokens: int = 24,
        eos_token_ids: tuple[int, ...] = (EOS_TOKEN_ID,),
        **sampling: Any,
    ) -> GenerationRequest:
        """A request for `PROMPT_IDS` (the model's end-of-sequence id: `EOS_TOKEN_ID`)."""
        return GenerationRequest(
            request_id=f"request-{next(self._request_ids)}",
            model=MODEL_NAME,
            prompt_token_ids=PROMPT_IDS,
            sampling=SamplingParams(seed=seed, max_tokens=max_tokens, **sampling),
            eos_token_ids=eos_token_ids,
        )

    def stream(
        self,
        request: GenerationRequest,
        timeout_s: float = 5.0,
        timeline: TtftTimeline | None = None,
    ) -> AsyncGenerator[OrchestratorEvent, None]:
        """`Orchestrator.run` with a deadline `timeout_s` from now."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        active = ActiveRequest(request, deadline, timeline=timeline or TtftTimeline())
        return self.orchestrator.run(active)

    async def run(
        self,
        request: GenerationRequest,
        timeout_s: float = 5.0,
        timeline: TtftTimeline | None = None,
    ) -> Completion:
        """Runs `request` to its end; returns once its cleanup calls are done too."""
        chunks: list[TokenChunk] = []
        ends: list[GenerationEnd] = []
        try:
            async for event in self.stream(request, timeout_s, timeline):
                (chunks if isinstance(event, TokenChunk) else ends).append(event)  # type: ignore[arg-type]
        finally:
            await self.orchestrator.wait_for_cleanups()
        assert len(ends) == 1, "not exactly one GenerationEnd"
        return Completion(chunks, ends[0])


def expected(request: GenerationRequest) -> list[int]:
    """The tokens an undisturbed run of `request` generates."""
    sampling = request.sampling
    return expected_tokens(
        request.prompt_token_ids,
        resolve_seed(sampling.seed),
        sampling.max_tokens,
        sampling.stop_token_ids,
    )
