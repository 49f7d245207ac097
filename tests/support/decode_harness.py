"""A local 'prefill' that computes and ships real KV, and a client for a real decode server."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.common.generation import SamplingParams, num_blocks_for, resolve_seed
from pdserve.decode.server import DecodeInstance
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.colocated import LLMEngine
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.prefill.convert import lease_from_proto
from pdserve.prefill.kv.sender import sync_cache_messages
from pdserve.prefill.request import Request
from pdserve.serving.convert import local_protocol
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import decode_pb2, decode_pb2_grpc, instance_pb2, instance_pb2_grpc

BLOCK_SIZE = 4


def load_host(model_dir: Path, num_blocks: int) -> ModelHost:
    return ModelHost.load(
        str(model_dir),
        "tiny",
        num_blocks=num_blocks,
        kv_cache_memory_mb=64,
        block_size=BLOCK_SIZE,
        dtype="float32",
        device="cpu",
        max_model_len=None,
    )


@dataclass
class Prefilled:
    """A prompt whose KV sits in the local sender's cache."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    first_token_id: int


@dataclass
class LocalPrefill:
    """Plays the prefill's part with the real engine (computes KV and ships it), and gives
    the single-process `LLMEngine` reference output."""

    host: ModelHost
    pool: BlockPool = field(init=False)
    sampler: Sampler = field(default_factory=Sampler)
    engine: LLMEngine | None = None

    def __post_init__(self) -> None:
        self.pool = BlockPool(self.host.num_blocks)

    def prefill(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        generated: tuple[int, ...] = (),
    ) -> Prefilled:
        tokens = [*prompt, *generated]
        block_ids = self.pool.allocate(num_blocks_for(len(tokens), BLOCK_SIZE))
        logits = self.host.runner.execute([ScheduledChunk(tokens, 0, block_ids)])
        first = self.sampler(
            logits, [SamplingRow(sampling, resolve_seed(sampling.seed), len(generated))]
        )
        return Prefilled(request_id, tokens, len(prompt), sampling, block_ids, first[0])

    def reference(self, prompt: list[int], sampling: SamplingParams) -> list[int]:
        """The single-process engine's output for the same prompt and sampling."""
        if self.engine is None:
            config = EngineConfig(
                model=str(self.host.model_dir),
                dtype="float32",
                cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=256),
            )
            self.engine = LLMEngine(config)
        return self.engine.generate([prompt], sampling)[0]

    def sync_messages(
        self, prefilled: Prefilled, lease: decode_pb2.Lease, token: bytes | None = None
    ) -> Iterator[decode_pb2.SyncCacheRequest]:
        """The SyncCache stream the prefill's sender writes for `prefilled` into `lease`
        (presenting the lease's own token unless `token` is given)."""
        request = Request(
            request_id=prefilled.request_id,
            token_ids=prefilled.token_ids,
            num_prompt_tokens=prefilled.num_prompt_tokens,
            sampling=prefilled.sampling,
            seed=resolve_seed(prefilled.sampling.seed),
            decode_address="",
            block_ids=prefilled.block_ids,
        )
        request.lease = lease_from_proto(lease)
        if token is not None:
            request.lease = dataclasses.replace(request.lease, transport_token=token)
        return sync_cache_messages(
            request,
            self.host.runner.kv_cache,
            prefilled.first_token_id,
            max_chunk_bytes=1024,  # one block per chunk: many chunks
        )

    def free(self, prefilled: Prefilled) -> None:
        self.pool.free(prefilled.block_ids)


@dataclass
class DecodeClient:
    """Stubs for one decode server plus the steps of a handoff."""

    instance: DecodeInstance
    channel: grpc.aio.Channel
    local: LocalPrefill

    @property
    def decode(self) -> decode_pb2_grpc.DecodeServiceStub:
        return decode_pb2_grpc.DecodeServiceStub(self.channel)

    async def allocate(
        self, prefilled: Prefilled, max_new_tokens: int | None = None, share_key: str = ""
    ) -> decode_pb2.Lease:
        response = await self.decode.AllocateBlocks(
            decode_pb2.AllocateBlocksRequest(
                request_id=prefilled.request_id,
                num_prompt_tokens=len(prefilled.token_ids),
                max_new_tokens=max_new_tokens or prefilled.sampling.max_tokens,
                kv_layout=self.local.host.kv_layout,
                protocol=local_protocol(),
                share_key=share_key,
            )
        )
        return response.lease

    async def sync(
        self, prefilled: Prefilled, lease: decode_pb2.Lease, token: bytes | None = None
    ) -> decode_pb2.SyncCacheResponse:
        messages = self.local.sync_messages(prefilled, lease, token)
        return await self.decode.SyncCache(iter(messages))

    async def collect(self, lease_id: str, request_id: str = "") -> list[object]:
        """Every Generate message, as ('tokens', ids, first_index) / ('finished', msg) /
        ('preemption', notice)."""
        out: list[object] = []
        request = decode_pb2.DecodeServiceGenerateRequest(request_id=request_id, lease_id=lease_id)
        async for message in self.decode.Generate(request):
            kind = message.WhichOneof("event")
            if kind == "tokens":
                out.append(("tokens", list(message.tokens.token_ids), message.tokens.first_index))
            else:
                out.append((kind, getattr(message, kind)))
        return out

    async def pool(self) -> instance_pb2.GetInstanceStatusResponse:
        stub = instance_pb2_grpc.InstanceServiceStub(self.channel)
        return await stub.GetInstanceStatus(
            instance_pb2.GetInstanceStatusRequest(check_integrity=True)
        )

    async def is_whole(self) -> bool:
        """Whether `assert_whole` would pass now (for waiting on it)."""
        status = await self.pool()
        pool = status.pool
        return (
            pool.is_consistent
            and pool.num_open_leases == 0
            and pool.num_free_blocks == pool.num_total_blocks
        )

    async def assert_whole(self) -> None:
        """Invariant 3: the pool is consistent and every block is free again."""
        status = await self.pool()
        assert status.pool.is_consistent, status.pool.detail
        assert status.pool.num_open_leases == 0
        assert status.pool.num_free_blocks == status.pool.num_total_blocks


def tokens_of(messages: list[object]) -> tuple[list[int], list[int]]:
    """(token ids in order, their completion indices) from `collect` output."""
    ids: list[int] = []
    indices: list[int] = []
    for message in messages:
        if message[0] == "tokens":  # type: ignore[index]
            _, batch, first = message  # type: ignore[misc]
            ids.extend(batch)
            indices.extend(range(first, first + len(batch)))
    return ids, indices
