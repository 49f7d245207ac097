"""A whole cluster of real services in one process: gateway, prefills and decodes on port 0.

The prefills and decodes register with the gateway over RegistryService, exactly as separate
processes would, and every internal call is mutual TLS under the test CA (`support.pki`); the
model is the built-in demo model (it has a tokenizer and chat template).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai

from pdserve.common.generation import SamplingParams
from pdserve.decode.config import DecodeConfig
from pdserve.decode.server import DecodeInstance
from pdserve.decode.server import create_server as create_decode
from pdserve.engine.colocated import LLMEngine
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.server import GatewayServer
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.server import PrefillInstance
from pdserve.prefill.server import create_server as create_prefill
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import instance_pb2, instance_pb2_grpc
from support.pki import cluster_pki

MODEL_NAME = "demo"
BLOCK_SIZE = 16


class RealCluster:
    """Real services for one test; `close()` stops them all."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.gateway: GatewayServer | None = None
        self.prefills: list[PrefillInstance] = []
        self.decodes: list[DecodeInstance] = []

    async def start(
        self,
        *,
        prefills: int = 1,
        decodes: int = 1,
        decode_overrides: Any = (),
        instance_settings: Any = None,
        prefill_settings: Any = None,
        **gateway: Any,
    ) -> RealCluster:
        """Starts the gateway, then the instances, and waits until all registered.

        Args:
            prefills: Number of prefill instances.
            decodes: Number of decode instances.
            decode_overrides: One dict of DecodeConfig overrides per decode (or empty).
            instance_settings: Settings of every prefill and decode (e.g. ``kv_store``).
            prefill_settings: PrefillConfig overrides of every prefill.
            gateway: GatewayConfig overrides.
        """
        settings = {"host": "127.0.0.1", "port": 0, "grpc_port": 0, "internal_port": 0,
                    "request_timeout": 30.0, "shutdown_grace_s": 0.5, "heartbeat_interval_s": 0.2,
                    **cluster_pki().config("gateway"), **gateway}  # fmt: skip
        self.gateway = GatewayServer(GatewayConfig(**settings))
        await self.gateway.start()
        common = {"model": str(self.model_dir), "served_model_name": MODEL_NAME, "port": 0,
                  "gateway": self.internal_address, "block_size": BLOCK_SIZE, "dtype": "float32",
                  "metrics_port": 0, **(instance_settings or {})}  # fmt: skip
        for _ in range(prefills):
            await self.add_prefill(**common, **(prefill_settings or {}))
        overrides = list(decode_overrides) or [{}] * decodes
        for extra in overrides:
            await self.add_decode(**{**common, "num_blocks": 256, **extra})
        await self.wait_registered()
        return self

    async def add_prefill(self, **settings: Any) -> PrefillInstance:
        instance = await create_prefill(
            PrefillConfig(**{**cluster_pki().config("prefill"), **settings})
        )
        self.prefills.append(instance)
        return instance

    async def add_decode(self, **settings: Any) -> DecodeInstance:
        instance = await create_decode(
            DecodeConfig(**{**cluster_pki().config("decode"), **settings})
        )
        self.decodes.append(instance)
        return instance

    async def wait_registered(self, timeout_s: float = 20.0) -> None:
        clients = [i.registration for i in [*self.prefills, *self.decodes]]
        await asyncio.wait_for(
            asyncio.gather(*(c.is_registered.wait() for c in clients if c is not None)), timeout_s
        )

    @property
    def grpc_address(self) -> str:
        assert self.gateway is not None
        return f"127.0.0.1:{self.gateway.grpc_port}"

    @property
    def internal_address(self) -> str:
        assert self.gateway is not None
        return f"127.0.0.1:{self.gateway.internal_port}"

    @property
    def base_url(self) -> str:
        assert self.gateway is not None
        return f"http://127.0.0.1:{self.gateway.http_port}"

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=60.0
        )

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=60.0)

    async def pool_status(self, address: str) -> instance_pb2.GetInstanceStatusResponse:
        channel = cluster_pki().channel(address)
        try:
            stub = instance_pb2_grpc.InstanceServiceStub(channel)
            request = instance_pb2.GetInstanceStatusRequest(check_integrity=True)
            return await stub.GetInstanceStatus(request, timeout=5)
        finally:
            await channel.close()

    async def assert_whole(self, timeout_s: float = 5.0) -> None:
        """Invariant 3 on every live instance: consistent pools, all blocks free, no leases."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        addresses = [i.address for i in self.prefills] + [i.address for i in self.decodes]
        while True:
            problems = []
            for address in addresses:
                status = (await self.pool_status(address)).pool
                if not status.is_consistent:
                    problems.append(f"{address}: {status.detail}")
                elif status.num_free_blocks != status.num_total_blocks or status.num_open_leases:
                    problems.append(
                        f"{address}: {status.num_free_blocks}/{status.num_total_blocks} free, "
                        f"{status.num_open_leases} open leases"
                    )
            if not problems:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError("; ".join(problems))
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop(0.5)
        for instance in [*self.prefills, *self.decodes]:
            await instance.stop(grace=None)


class Reference:
    """The single-process engine and the tokenizer, for expected outputs (one generation at a
    time: callers on several threads take turns). `deterministic`: batch-invariant numerics, as
    a cluster whose instances run ``--deterministic`` (needed where a stream moves and its
    tokens are compared: its new decode recomputes its K/V in a prefill)."""

    def __init__(self, model_dir: Path, *, deterministic: bool = False) -> None:
        self.model_dir = model_dir
        self.deterministic = deterministic
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        # NOTE: float32 here and in the cluster: the outputs must be equal token for token.
        config = EngineConfig(
            model=str(model_dir),
            dtype="float32",
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=512),
            deterministic=deterministic,
        )
        self.engine = LLMEngine(config)
        self._turn = threading.Lock()

    def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> list[int]:
        with self._turn:
            return self.engine.generate([prompt_ids], sampling)[0]

    def completion(self, prompt: str, **sampling: Any) -> list[int]:
        return self.generate(self.tokenizer.encode(prompt), SamplingParams(**sampling))

    def completions(self, requests: Sequence[tuple[str, Mapping[str, Any]]]) -> list[list[int]]:
        """The tokens of each ``(prompt, sampling)`` in `requests` (``max_tokens`` among the
        sampling), as `completion` gives each alone. A deterministic reference runs them as one
        batch: batch-invariant numerics give each request its tokens alone whatever runs beside
        it (`tests/unit/engine/test_batch_invariant.py`), in a fraction of the steps."""
        if not self.deterministic:
            return [self.completion(prompt, **sampling) for prompt, sampling in requests]
        prompts = [self.tokenizer.encode(prompt) for prompt, _ in requests]
        params = [SamplingParams(**sampling) for _, sampling in requests]
        with self._turn:
            return self.engine.generate(prompts, params)

    def chat(self, messages: list[dict[str, str]], **sampling: Any) -> list[int]:
        return self.generate(self.tokenizer.encode_chat(messages), SamplingParams(**sampling))

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


def replace(params: SamplingParams, **changes: Any) -> SamplingParams:
    return dataclasses.replace(params, **changes)
