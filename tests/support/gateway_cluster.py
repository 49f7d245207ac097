"""A gateway on port 0 plus fake prefill/decode instances that register over RegistryService."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai

from pdserve.common.protocol import FEATURES, PROTOCOL_VERSION
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.fleet import convert
from pdserve.gateway.fleet.instance import InstanceInfo, InstanceRole
from pdserve.gateway.server import GatewayServer
from pdserve.v1 import common_pb2
from support.gateway_fakes import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    FakeDecode,
    FakePrefill,
    kv_layout,
    register,
    start_instance,
)


class Cluster:
    """One gateway plus the fakes a test adds; everything stops at the end of the test."""

    def __init__(self) -> None:
        self.gateway: GatewayServer | None = None
        self.prefills: list[FakePrefill] = []
        self.decodes: list[FakeDecode] = []

    def script(self, text: str) -> None:
        """Makes every completion `text` (then the end-of-sequence token)."""
        for instance in [*self.prefills, *self.decodes]:
            instance.knobs.script = text.encode()

    def sent_constraint(self) -> common_pb2.Constraint | None:
        """The constraint the first prefill's last request carried, if any."""
        sampling = self.prefills[0].requests[-1].sampling
        return sampling.constraint if sampling.HasField("constraint") else None

    async def start_gateway(self, **overrides: Any) -> GatewayServer:
        settings: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "grpc_port": 0,
            "internal_port": 0,
            "insecure": True,
            "request_timeout": 20.0,
            "shutdown_grace_s": 0.5,
            # The fakes register once and send no heartbeats: with the default 10 s TTL a test
            # that runs longer than that on a busy machine lost its instances mid-test (503
            # "no healthy pair"). Tests of expiry set their own TTL and send heartbeats.
            "instance_ttl_s": 3600.0,
            **overrides,
        }
        self.gateway = GatewayServer(GatewayConfig(**settings))
        await self.gateway.start()
        return self.gateway

    @property
    def grpc_address(self) -> str:
        assert self.gateway is not None
        return f"127.0.0.1:{self.gateway.grpc_port}"

    @property
    def internal_address(self) -> str:
        """The gateway's internal port (RegistryService)."""
        assert self.gateway is not None
        return f"127.0.0.1:{self.gateway.internal_port}"

    @property
    def base_url(self) -> str:
        assert self.gateway is not None
        return f"http://127.0.0.1:{self.gateway.http_port}"

    async def add_prefill(
        self,
        instance_id: str = "prefill-0",
        *,
        num_queued_prompt_tokens: int = 0,
        is_registered: bool = True,
        max_model_len: int = MAX_MODEL_LEN,
        setup: Callable[[FakePrefill], None] | None = None,
    ) -> FakePrefill:
        """Starts a fake prefill and registers it (reporting the given queue length); `setup`
        configures it first (what the gateway reads from it once it registers: its model)."""
        prefill = await start_instance(FakePrefill(instance_id))
        assert isinstance(prefill, FakePrefill)
        prefill.max_model_len = max_model_len
        prefill.queued_prompt_tokens = num_queued_prompt_tokens
        if setup is not None:
            setup(prefill)
        self.prefills.append(prefill)
        if is_registered:
            await register(self.internal_address, prefill)
        return prefill

    async def add_decode(
        self,
        instance_id: str = "decode-0",
        *,
        num_total_blocks: int = 1000,
        is_registered: bool = True,
        max_model_len: int = MAX_MODEL_LEN,
    ) -> FakeDecode:
        """Starts a fake decode and registers it (more blocks: preferred by the router)."""
        decode = await start_instance(FakeDecode(instance_id, num_total_blocks))
        assert isinstance(decode, FakeDecode)
        decode.max_model_len = max_model_len
        self.decodes.append(decode)
        if is_registered:
            await register(self.internal_address, decode)
        return decode

    def openai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=20.0
        )

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=20.0)

    async def close(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop(0.5)
        for instance in [*self.prefills, *self.decodes]:
            await instance.stop()


def instance_info(
    instance_id: str,
    role: InstanceRole,
    *,
    model_id: str = "tiny-model-v1",
    protocol_version: str = PROTOCOL_VERSION,
    max_model_len: int = MAX_MODEL_LEN,
    features: tuple[str, ...] = FEATURES,
) -> InstanceInfo:
    """A valid gateway-side `InstanceInfo` for registry and router tests (advertising
    `features`: this implementation's by default)."""
    return convert.instance_info_from_pb(
        common_pb2.InstanceInfo(
            instance_id=instance_id,
            role=common_pb2.INSTANCE_ROLE_PREFILL
            if role is InstanceRole.PREFILL
            else common_pb2.INSTANCE_ROLE_DECODE,
            address=f"{instance_id}.invalid:1",
            protocol=common_pb2.Protocol(version=protocol_version, features=list(features)),
            kv_layout=kv_layout(model_id),
            model_name=MODEL_NAME,
            max_model_len=max_model_len,
        )
    )
