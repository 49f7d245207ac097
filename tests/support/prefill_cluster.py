"""Real prefill and decode servers in one process, plus clients and fault interceptors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.common import errors
from pdserve.common.generation import SamplingParams
from pdserve.common.grpc_server import insecure_channel
from pdserve.decode.config import DecodeConfig
from pdserve.decode.server import DecodeInstance
from pdserve.decode.server import create_server as create_decode
from pdserve.engine.colocated import LLMEngine
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.server import PrefillInstance
from pdserve.prefill.server import create_server as create_prefill
from pdserve.serving.convert import local_protocol, sampling_to_proto
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    instance_pb2,
    instance_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from support.eventually import eventually
from support.process_cluster import forced_kv_transport

BLOCK_SIZE = 4


def load_host(
    model_dir: Path,
    num_blocks: int,
    tensor_parallel_size: int = 1,
    decode: DecodeConfig | None = None,
) -> ModelHost:
    """A tiny model's host; split over `tensor_parallel_size` ranks (one thread each); a
    `decode`'s cache as that decode sizes it (its window slots, ``--release-window-blocks``)."""
    return ModelHost.load(
        str(model_dir),
        "tiny",
        num_blocks=num_blocks,
        kv_cache_memory_mb=64,
        block_size=BLOCK_SIZE,
        dtype="float32",
        device="cpu",
        max_model_len=None,
        num_threads=1 if tensor_parallel_size > 1 else None,
        tensor_parallel_size=tensor_parallel_size,
        max_seqs=None if decode is None else decode.kv_cache_max_seqs,
        release_window_blocks=decode is not None and decode.kv_cache_releases_window_blocks,
        max_step_tokens=None if decode is None else decode.max_num_seqs,
        **(
            {}
            if decode is None
            else {"tensor_parallel_step_timeout_s": decode.tensor_parallel_step_timeout_s}
        ),
    )


class Delay(grpc.aio.ServerInterceptor):
    """Delays the start of one method's handler (a slow peer); `delay_s` may change any time.
    With a `gate`, each call also waits until the gate is set (a peer held until the test says:
    what a test shows then does not depend on the machine's speed)."""

    def __init__(self, method: str, delay_s: float, gate: asyncio.Event | None = None) -> None:
        self.method = method
        self.delay_s = delay_s
        self.gate = gate
        self.num_calls = 0
        self.num_ended = 0  # calls over: answered, failed, or cancelled (by a deadline, say)

    async def _wait(self) -> None:
        await asyncio.sleep(self.delay_s)
        if self.gate is not None:
            await self.gate.wait()

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.endswith(f"/{self.method}"):
            return handler
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def delayed_unary(request, context):  # type: ignore[no-untyped-def]
                self.num_calls += 1
                try:
                    await self._wait()
                    return await unary(request, context)
                finally:
                    self.num_ended += 1

            return grpc.unary_unary_rpc_method_handler(
                delayed_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        stream_unary = handler.stream_unary

        async def delayed_stream(request_iterator, context):  # type: ignore[no-untyped-def]
            self.num_calls += 1
            try:
                await self._wait()
                return await stream_unary(request_iterator, context)
            finally:
                self.num_ended += 1

        return grpc.stream_unary_rpc_method_handler(
            delayed_stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


async def start_decode(
    model_dir: Path,
    *,
    num_blocks: int = 128,
    lease_ttl_ms: int = 10_000,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    tensor_parallel_size: int = 1,
    **overrides: object,
) -> DecodeInstance:
    settings: dict[str, object] = {"port": 0, **overrides}
    config = DecodeConfig(
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        lease_ttl_ms=lease_ttl_ms,
        insecure=True,
        **settings,  # type: ignore[arg-type]
    )
    host = load_host(model_dir, num_blocks, tensor_parallel_size, config)
    return await create_decode(config, host, interceptors=interceptors)


async def start_prefill(
    model_dir: Path, tensor_parallel_size: int = 1, **overrides: object
) -> PrefillInstance:
    settings: dict[str, object] = {
        "port": 0,
        "block_size": BLOCK_SIZE,
        "num_blocks": 64,
        "max_num_batched_tokens": 16,
        "allocate_timeout_ms": 5000,
        "max_chunk_bytes": 2048,
        "insecure": True,
    }
    forced = forced_kv_transport()
    if forced is not None:
        settings["kv_transports"] = forced
    settings.update(overrides)
    config = PrefillConfig(**settings)  # type: ignore[arg-type]
    host = load_host(model_dir, config.num_blocks or 64, tensor_parallel_size)
    return await create_prefill(config, host)


def reference_engine(model_dir: Path) -> LLMEngine:
    """The single-process engine the disaggregated output must equal (float32, as the
    instances' hosts)."""
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=256),
    )
    return LLMEngine(config)


@dataclass
class Events:
    """What one Prefill stream delivered, with arrival times."""

    messages: list[prefill_pb2.PrefillResponse] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: errors.PdserveError | None = None

    @property
    def kinds(self) -> list[str]:
        return [str(m.WhichOneof("event")) for m in self.messages]

    def last(self, kind: str) -> prefill_pb2.PrefillResponse:
        return next(m for m in reversed(self.messages) if m.WhichOneof("event") == kind)


@dataclass
class Cluster:
    """One prefill and its decodes, with stubs."""

    prefill: PrefillInstance
    decodes: list[DecodeInstance]
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    def _channel(self, port: int) -> grpc.aio.Channel:
        channel = insecure_channel(f"127.0.0.1:{port}")
        self.channels.append(channel)
        return channel

    def __post_init__(self) -> None:
        prefill_channel = self._channel(self.prefill.port)
        self.stub = prefill_pb2_grpc.PrefillServiceStub(prefill_channel)
        self.prefill_status = instance_pb2_grpc.InstanceServiceStub(prefill_channel)
        self.decode_stubs = []
        self.decode_status = []
        for decode in self.decodes:
            channel = self._channel(decode.port)
            self.decode_stubs.append(decode_pb2_grpc.DecodeServiceStub(channel))
            self.decode_status.append(instance_pb2_grpc.InstanceServiceStub(channel))

    def request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        decode: int = 0,
        num_prompt_tokens: int = 0,
        share_key: str = "",
    ) -> prefill_pb2.PrefillRequest:
        return prefill_pb2.PrefillRequest(
            request_id=request_id,
            token_ids=list(token_ids),
            num_prompt_tokens=num_prompt_tokens,
            sampling=sampling_to_proto(sampling),
            decode=prefill_pb2.DecodeTarget(
                address=f"127.0.0.1:{self.decodes[decode].port}",
                instance_id=self.decodes[decode].status.instance.instance_id,
            ),
            protocol=local_protocol(),
            share_key=share_key,
        )

    async def run_prefill(self, message: prefill_pb2.PrefillRequest) -> Events:
        """Runs one Prefill stream to its end (an error status lands in `error`)."""
        events = Events()
        try:
            async for response in self.stub.Prefill(message):
                events.messages.append(response)
                events.times.append(time.monotonic())
        except grpc.aio.AioRpcError as error:
            events.error = errors.from_rpc_error(error)
            events.times.append(time.monotonic())
        return events

    async def generate(self, lease_id: str, decode: int = 0) -> tuple[list[int], list[int]]:
        """Every decode token of a lease, and their completion indices."""
        ids: list[int] = []
        indices: list[int] = []
        request = decode_pb2.DecodeServiceGenerateRequest(lease_id=lease_id)
        async for message in self.decode_stubs[decode].Generate(request):
            if message.WhichOneof("event") == "tokens":
                ids.extend(message.tokens.token_ids)
                first = message.tokens.first_index
                indices.extend(range(first, first + len(message.tokens.token_ids)))
        return ids, indices

    async def complete(
        self,
        request_id: str,
        token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        decode: int = 0,
        num_prompt_tokens: int = 0,
    ) -> list[int]:
        """Prefill then decode: the whole continuation after `token_ids`."""
        message = self.request(
            request_id, token_ids, sampling, decode=decode, num_prompt_tokens=num_prompt_tokens
        )
        events = await self.run_prefill(message)
        assert events.error is None, events.error
        first = events.messages[0].first_token
        assert first.index == len(token_ids) - (num_prompt_tokens or len(token_ids))
        if events.kinds[-1] == "finished":
            return [first.token_id]
        assert events.kinds == ["first_token", "handed_off"], events.kinds
        lease_id = events.last("handed_off").handed_off.lease_id
        ids, indices = await self.generate(lease_id, decode)
        assert indices == list(range(first.index + 1, first.index + 1 + len(ids)))
        return [first.token_id, *ids]

    async def allocate(self, num_tokens: int, request_id: str = "r") -> decode_pb2.Lease:
        """A lease of `num_tokens` prompt tokens (and 4 new ones) from the first decode, asked
        for as a prefill asks (a test that then speaks a transport itself)."""
        layout = self.decodes[0].host.kv_layout
        response = await self.decode_stubs[0].AllocateBlocks(
            decode_pb2.AllocateBlocksRequest(
                request_id=request_id,
                num_prompt_tokens=num_tokens,
                max_new_tokens=4,
                kv_layout=common_pb2.KvLayout(fingerprint=layout.fingerprint),
                protocol=local_protocol(),
            )
        )
        return response.lease

    async def prefill_pool(self) -> instance_pb2.GetInstanceStatusResponse:
        return await self.prefill_status.GetInstanceStatus(
            instance_pb2.GetInstanceStatusRequest(check_integrity=True)
        )

    async def decode_pool(self, decode: int = 0) -> instance_pb2.GetInstanceStatusResponse:
        return await self.decode_status[decode].GetInstanceStatus(
            instance_pb2.GetInstanceStatusRequest(check_integrity=True)
        )

    async def assert_whole(self) -> None:
        """Invariant 3 on every instance: consistent pools, all blocks free, no open lease."""
        statuses = [await self.prefill_pool()]
        statuses += [await self.decode_pool(i) for i in range(len(self.decodes))]
        for status in statuses:
            pool = status.pool
            assert pool.is_consistent, pool.detail
            assert pool.num_open_leases == 0, status.instance.instance_id
            assert pool.num_free_blocks == pool.num_total_blocks, status.instance.instance_id

    async def eventually_whole(self, timeout_s: float = 30.0) -> None:
        """`assert_whole`, allowing `timeout_s` for work already under way to settle."""

        async def is_whole() -> bool:
            try:
                await self.assert_whole()
            except AssertionError:
                return False
            return True

        try:
            await eventually(is_whole, timeout_s, "every pool to be whole")
        except AssertionError:
            await self.assert_whole()  # NOTE: fails with the pool's own message
            raise

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        await self.prefill.stop(grace=None)
        for decode in self.decodes:
            await decode.stop(grace=None)
        # NOTE: the hosts are the cluster's, not the servers': a split model's ranks stop here.
        for instance in (self.prefill, *self.decodes):
            instance.host.runner.close()


@contextlib.asynccontextmanager
async def cluster(
    model_dir: Path,
    *,
    num_decodes: int = 1,
    decode_interceptors: Sequence[Sequence[grpc.aio.ServerInterceptor]] = (),
    decode_blocks: int = 128,
    decode_overrides: dict[str, object] | None = None,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    **prefill_overrides: object,
) -> AsyncIterator[Cluster]:
    """A prefill and `num_decodes` decodes (decode i built with `decode_interceptors[i]`),
    their models split over `prefill_tp` and `decode_tp` ranks."""
    decodes = []
    for i in range(num_decodes):
        interceptors = decode_interceptors[i] if i < len(decode_interceptors) else ()
        decodes.append(
            await start_decode(
                model_dir,
                num_blocks=decode_blocks,
                interceptors=interceptors,
                tensor_parallel_size=decode_tp,
                **(decode_overrides or {}),
            )
        )
    prefill = await start_prefill(model_dir, prefill_tp, **prefill_overrides)
    running = Cluster(prefill, decodes)
    try:
        yield running
    finally:
        await running.close()
