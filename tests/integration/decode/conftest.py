"""A real decode server on port 0, fed by a local prefill that ships real KV."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.decode_harness import BLOCK_SIZE, DecodeClient, LocalPrefill, load_host

from pdserve.common.grpc_server import insecure_channel
from pdserve.decode.config import DecodeConfig
from pdserve.decode.server import create_server


@pytest.fixture(scope="module")
def local_prefill(tiny_model_dir: Path) -> LocalPrefill:
    return LocalPrefill(load_host(tiny_model_dir, num_blocks=512))


@pytest.fixture
def decode_config() -> DecodeConfig:
    return DecodeConfig(
        port=0, block_size=BLOCK_SIZE, num_blocks=64, lease_ttl_ms=5000, insecure=True
    )


@pytest.fixture
async def client(
    tiny_model_dir: Path, decode_config: DecodeConfig, local_prefill: LocalPrefill
) -> AsyncIterator[DecodeClient]:
    host = load_host(tiny_model_dir, decode_config.num_blocks or 64)
    instance = await create_server(decode_config, host)
    channel = insecure_channel(f"127.0.0.1:{instance.port}")
    yield DecodeClient(instance, channel, local_prefill)
    await channel.close()
    await instance.stop(grace=None)
