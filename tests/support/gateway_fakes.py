"""In-process fake prefill and decode instances that follow the pdserve.v1 contract.

They run on grpc.aio servers bound to 127.0.0.1 port 0 and talk to each other exactly as the
real services do: the fake prefill leases blocks with ``AllocateBlocks`` on the decode named in
the request, ships a (KV-less) ``SyncCache`` header + commit carrying the first token, and
reports ``FirstToken`` then ``HandedOff``; the fake decode's ``Generate`` streams the rest.

Instead of a model, every token is a pure function of (original prompt, seed, completion
index) (`fake_token`), so a continuation on any instance yields exactly the tokens an
undisturbed run would, and tests can compute the expected completion (`expected_tokens`).
Knobs make failures happen on purpose: refuse allocations, preempt after k tokens, pause
mid-stream (so a test can stop the server), hold a prefill before hand-off. These fakes are for
tests of the edges (REST, gRPC, registry, clients); orchestration alone is tested over the
in-memory backend (`support.memory_backend`), which shares their tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from pdserve.common import errors
from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.generation import check_stop, num_blocks_for
from pdserve.common.grpc_server import add_standard_services, insecure_channel, new_aio_server
from pdserve.common.protocol import (
    FEATURES,
    PROTOCOL_VERSION,
    check_compatible,
    kv_layout_fingerprint,
)
from pdserve.serving.convert import finish_reason_to_proto, sampling_from_proto
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    instance_pb2,
    instance_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 4
EOS_TOKEN = "<|eos|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>")
EOS_TOKEN_ID = 256  # the first added token after the 256 byte tokens
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPACE_EVERY = 6  # every 6th token is a space, so the text has words
BATCH_SIZE = 2  # tokens per TokenBatch of the fake decode


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def tokenizer_json() -> str:
    """A byte-level tokenizer: token id == byte value, plus four special tokens (256...)."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer.to_str()


TOKENIZER_CONFIG = {"eos_token": EOS_TOKEN, "chat_template": CHAT_TEMPLATE}


def kv_layout(model_id: str = "tiny-model-v1") -> common_pb2.KvLayout:
    """A valid KV layout (its fingerprint matches its fields)."""
    return common_pb2.KvLayout(
        model_id=model_id,
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        dtype=common_pb2.KV_DTYPE_FLOAT32,
        block_size=BLOCK_SIZE,
        fingerprint=kv_layout_fingerprint(model_id, 2, 2, 8, "KV_DTYPE_FLOAT32", BLOCK_SIZE),
    )


def fake_token(prompt_token_ids: Sequence[int], seed: int, index: int) -> int:
    """The token at completion `index`: a letter, or a space every `SPACE_EVERY` tokens."""
    if index % SPACE_EVERY == SPACE_EVERY - 1:
        return ord(" ")
    digest = zlib.crc32(bytes(t % 256 for t in prompt_token_ids) + seed.to_bytes(8, "little"))
    return ord("a") + (digest + 7 * index + index * index) % 26


def expected_tokens(
    prompt_token_ids: Sequence[int],
    seed: int,
    max_tokens: int,
    stop_token_ids: Sequence[int] = (),
    eos_index: int | None = None,
) -> list[int]:
    """What an undisturbed run generates."""
    tokens = []
    for index in range(max_tokens):
        token = EOS_TOKEN_ID if index == eos_index else fake_token(prompt_token_ids, seed, index)
        tokens.append(token)
        if token in stop_token_ids or token == EOS_TOKEN_ID:
            break
    return tokens


def fake_text(token_ids: Sequence[int]) -> str:
    """The text of `token_ids` (the byte tokens; the special ones write none)."""
    return bytes(t for t in token_ids if t < 256).decode()


def chat_prompt_ids(*messages: tuple[str, str]) -> list[int]:
    """The prompt `CHAT_TEMPLATE` makes of ``(role, content)`` messages, ready for the
    assistant's turn."""
    role_ids = {
        role: EOS_TOKEN_ID + 1 + i for i, role in enumerate(("system", "user", "assistant"))
    }
    ids: list[int] = []
    for role, content in messages:
        ids += [role_ids[role], *content.encode()]
    return [*ids, role_ids["assistant"]]


def _protocol() -> common_pb2.Protocol:
    return common_pb2.Protocol(version=PROTOCOL_VERSION, features=list(FEATURES))


def _ends(token: int, sampling: common_pb2.SamplingParams, index: int) -> int:
    """FINISH_REASON_* if generating `token` at `index` ends the completion (the services' stop
    rule), else 0."""
    reason = check_stop(token, index + 1, sampling_from_proto(sampling), (EOS_TOKEN_ID,))
    return 0 if reason is None else finish_reason_to_proto(reason)


@dataclass
class _Lease:
    lease_id: str
    request_id: str
    num_blocks: int
    committed: asyncio.Event = field(default_factory=asyncio.Event)
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    sampling: common_pb2.SamplingParams | None = None
    first_token_id: int = 0
    first_token_index: int = 0
    state: int = decode_pb2.LEASE_STATE_ALLOCATED


@dataclass
class InstanceKnobs:
    """Behaviour switches a test flips on a fake instance."""

    refuse_allocation: bool = False
    preempt_after: int | None = None
    num_preemptions: int = 1
    pause_after: int | None = None
    hold_before_handoff: bool = False
    eos_index: int | None = None
    script: bytes | None = None  # the completion's bytes (token id == byte), then EOS
    script_ids: tuple[int, ...] | None = None  # the completion's token ids, then EOS

    def token(self, prompt_token_ids: Sequence[int], seed: int, index: int) -> int:
        """The token at completion `index`: the script's, else `fake_token`'s (or EOS)."""
        if self.script_ids is not None:
            return self.script_ids[index] if index < len(self.script_ids) else EOS_TOKEN_ID
        if self.script is not None:
            return self.script[index] if index < len(self.script) else EOS_TOKEN_ID
        if index == self.eos_index:
            return EOS_TOKEN_ID
        return fake_token(prompt_token_ids, seed, index)


class FakeInstance:
    """Identity, load and bookkeeping shared by the fake prefill and decode."""

    def __init__(self, role: int, instance_id: str, num_total_blocks: int) -> None:
        self.role = role
        self.instance_id = instance_id
        self.knobs = InstanceKnobs()
        self.num_total_blocks = num_total_blocks
        self.max_model_len = MAX_MODEL_LEN
        self.address = ""
        self.protocol_version = PROTOCOL_VERSION
        self.features = FEATURES
        self.layout = kv_layout()
        self.server: grpc.aio.Server | None = None
        self.paused = asyncio.Event()  # set when a `pause_after` stream has paused
        self.resume = asyncio.Event()

    def info(self) -> common_pb2.InstanceInfo:
        return common_pb2.InstanceInfo(
            instance_id=self.instance_id,
            role=self.role,
            address=self.address,
            protocol=common_pb2.Protocol(
                version=self.protocol_version, features=list(self.features)
            ),
            kv_layout=self.layout,
            model_name=MODEL_NAME,
            max_model_len=self.max_model_len,
        )

    def load(self) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(
            num_total_blocks=self.num_total_blocks,
            num_free_blocks=self.num_total_blocks,
        )

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)


class FakeDecode(FakeInstance, decode_pb2_grpc.DecodeServiceServicer):
    """DecodeService: leases, KV-less SyncCache, deterministic Generate."""

    def __init__(self, instance_id: str = "decode-0", num_total_blocks: int = 1000) -> None:
        super().__init__(common_pb2.INSTANCE_ROLE_DECODE, instance_id, num_total_blocks)
        self.leases: dict[str, _Lease] = {}
        self.allocations: list[str] = []
        self.released: list[str] = []
        self.generate_calls: list[str] = []
        self.num_preempted = 0

    @property
    def num_open_leases(self) -> int:
        return sum(
            1 for lease in self.leases.values() if lease.state < decode_pb2.LEASE_STATE_FINISHED
        )

    def _free(self, lease: _Lease, state: int) -> None:
        if lease.state < decode_pb2.LEASE_STATE_FINISHED:
            lease.state = state

    async def AllocateBlocks(
        self, request: decode_pb2.AllocateBlocksRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.AllocateBlocksResponse:
        self.allocations.append(request.request_id)
        try:
            check_compatible(request.protocol.version)
            if request.kv_layout.fingerprint != self.layout.fingerprint:
                raise PdserveError(ErrorReason.INCOMPATIBLE_PEER, "KV layout differs")
            if self.knobs.refuse_allocation:
                raise PdserveError(
                    ErrorReason.DECODE_CAPACITY_EXHAUSTED,
                    "no free blocks",
                    {"instanceId": self.instance_id, "requestId": request.request_id},
                    retry_delay_s=2.0,
                )
        except PdserveError as error:
            await errors.abort_with_error(context, error)
        num_tokens = request.num_prompt_tokens + request.max_new_tokens
        lease = _Lease(uuid.uuid4().hex, request.request_id, num_blocks_for(num_tokens, BLOCK_SIZE))
        self.leases[lease.lease_id] = lease
        return decode_pb2.AllocateBlocksResponse(
            lease=decode_pb2.Lease(
                lease_id=lease.lease_id,
                block_ids=list(range(lease.num_blocks)),
                block_size=BLOCK_SIZE,
                ttl_ms=30_000,
                decode_instance_id=self.instance_id,
                transports=[decode_pb2.Transport(kind=decode_pb2.TRANSPORT_KIND_GRPC_SYNC_CACHE)],
            ),
            protocol=_protocol(),
        )

    async def SyncCache(
        self,
        request_iterator: AsyncIterator[decode_pb2.SyncCacheRequest],
        context: grpc.aio.ServicerContext,
    ) -> decode_pb2.SyncCacheResponse:
        lease: _Lease | None = None
        async for part in request_iterator:
            kind = part.WhichOneof("part")
            if kind == "header":
                lease = self.leases.get(part.header.lease_id)
                if lease is None:
                    await errors.abort_with_error(
                        context, PdserveError(ErrorReason.LEASE_NOT_FOUND)
                    )
                lease.token_ids = list(part.header.token_ids)
                lease.num_prompt_tokens = part.header.num_prompt_tokens or len(lease.token_ids)
                lease.sampling = part.header.sampling
                lease.state = decode_pb2.LEASE_STATE_SYNCING
            elif kind == "commit" and lease is not None:
                lease.first_token_id = part.commit.first_token_id
                lease.first_token_index = part.commit.first_token_index
                lease.state = decode_pb2.LEASE_STATE_COMMITTED
                lease.committed.set()
        if lease is None or not lease.committed.is_set():
            await errors.abort_with_error(
                context, PdserveError(ErrorReason.CACHE_SYNC_FAILED, "no commit")
            )
        return decode_pb2.SyncCacheResponse(lease_id=lease.lease_id, state=lease.state)

    async def Generate(
        self, request: decode_pb2.DecodeServiceGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeServiceGenerateResponse]:
        self.generate_calls.append(request.lease_id)
        lease = self.leases.get(request.lease_id)
        if lease is None or lease.state >= decode_pb2.LEASE_STATE_FINISHED:
            await errors.abort_with_error(context, PdserveError(ErrorReason.LEASE_NOT_FOUND))
        await asyncio.wait_for(lease.committed.wait(), 30)
        lease.state = decode_pb2.LEASE_STATE_RUNNING
        sampling = lease.sampling
        assert sampling is not None
        prompt = lease.token_ids[: lease.num_prompt_tokens]
        generated = [*lease.token_ids[lease.num_prompt_tokens :], lease.first_token_id]
        knobs = self.knobs
        try:
            batch: list[int] = []
            first_index = lease.first_token_index + 1
            for num_here, index in enumerate(itertools.count(first_index)):
                if _ends(generated[-1], sampling, index - 1):
                    break
                if (
                    knobs.preempt_after is not None
                    and num_here >= knobs.preempt_after
                    and (self.num_preempted < knobs.num_preemptions)
                ):
                    if batch:
                        yield self._batch(batch, index - len(batch))
                    self.num_preempted += 1
                    self._free(lease, decode_pb2.LEASE_STATE_PREEMPTED)
                    yield decode_pb2.DecodeServiceGenerateResponse(
                        preemption=decode_pb2.PreemptionNotice(
                            reason=decode_pb2.PREEMPTION_REASON_OUT_OF_BLOCKS,
                            num_generated_tokens=len(generated),
                            generated_token_ids=generated,
                        )
                    )
                    return
                if knobs.pause_after is not None and num_here == knobs.pause_after:
                    if batch:
                        yield self._batch(batch, index - len(batch))
                        batch = []
                    self.paused.set()
                    await self.resume.wait()
                token = knobs.token(prompt, sampling.seed, index)
                generated.append(token)
                batch.append(token)
                if len(batch) >= BATCH_SIZE:
                    yield self._batch(batch, index + 1 - len(batch))
                    batch = []
            if batch:
                yield self._batch(batch, len(generated) - len(batch))
            reason = _ends(generated[-1], sampling, len(generated) - 1)
            self._free(lease, decode_pb2.LEASE_STATE_FINISHED)
            yield decode_pb2.DecodeServiceGenerateResponse(
                finished=common_pb2.Finished(
                    finish_reason=reason,
                    usage=common_pb2.Usage(
                        num_prompt_tokens=len(prompt), num_completion_tokens=len(generated)
                    ),
                )
            )
        finally:
            # NOTE: contract: cancelling the call releases the lease.
            self._free(lease, decode_pb2.LEASE_STATE_ABORTED)

    @staticmethod
    def _batch(tokens: list[int], first_index: int) -> decode_pb2.DecodeServiceGenerateResponse:
        return decode_pb2.DecodeServiceGenerateResponse(
            tokens=decode_pb2.TokenBatch(token_ids=list(tokens), first_index=first_index)
        )

    async def ReleaseLease(
        self, request: decode_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.ReleaseLeaseResponse:
        self.released.append(request.lease_id)
        lease = self.leases.get(request.lease_id)
        if lease is None:
            return decode_pb2.ReleaseLeaseResponse()
        self._free(lease, decode_pb2.LEASE_STATE_ABORTED)
        return decode_pb2.ReleaseLeaseResponse(state=lease.state)


class FakePrefill(FakeInstance, prefill_pb2_grpc.PrefillServiceServicer):
    """PrefillService: leases on the target decode, ships the first token, hands off."""

    def __init__(self, instance_id: str = "prefill-0") -> None:
        super().__init__(common_pb2.INSTANCE_ROLE_PREFILL, instance_id, 1000)
        self.requests: list[prefill_pb2.PrefillRequest] = []
        self.num_model_info_calls = 0
        self.queued_prompt_tokens = 0
        # what GetModelInfo sends (a test may give the model another tokenizer and template)
        self.tokenizer_json = TOKENIZER_JSON
        self.tokenizer_config: dict[str, object] = TOKENIZER_CONFIG
        self.chat_template = CHAT_TEMPLATE

    def load(self) -> common_pb2.LoadReport:
        load = super().load()
        load.num_queued_prompt_tokens = self.queued_prompt_tokens
        return load

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[prefill_pb2.PrefillResponse]:
        self.requests.append(request)
        try:
            check_compatible(request.protocol.version)
        except PdserveError as error:
            await errors.abort_with_error(context, error)
        num_prompt = request.num_prompt_tokens or len(request.token_ids)
        index = len(request.token_ids) - num_prompt
        sampling = request.sampling
        first = self.knobs.token(request.token_ids[:num_prompt], sampling.seed, index)
        channel = insecure_channel(request.decode.address)
        decode = decode_pb2_grpc.DecodeServiceStub(channel)
        lease_id = ""
        try:
            try:
                allocated = await decode.AllocateBlocks(
                    decode_pb2.AllocateBlocksRequest(
                        request_id=request.request_id,
                        num_prompt_tokens=len(request.token_ids),
                        max_new_tokens=sampling.max_tokens - index,
                        kv_layout=self.layout,
                        protocol=_protocol(),
                        prefill_instance_id=self.instance_id,
                    ),
                    timeout=5.0,
                )
                lease_id = allocated.lease.lease_id
                await decode.SyncCache(
                    iter(
                        [
                            decode_pb2.SyncCacheRequest(
                                header=decode_pb2.SyncCacheHeader(
                                    lease_id=lease_id,
                                    request_id=request.request_id,
                                    token_ids=request.token_ids,
                                    num_prompt_tokens=num_prompt,
                                    sampling=sampling,
                                )
                            ),
                            decode_pb2.SyncCacheRequest(
                                commit=decode_pb2.SyncCacheCommit(
                                    first_token_id=first, first_token_index=index
                                )
                            ),
                        ]
                    ),
                    timeout=5.0,
                )
            except grpc.aio.AioRpcError as rpc_error:
                error = errors.from_rpc_error(rpc_error)
                if error.reason is ErrorReason.PEER_UNAVAILABLE:
                    error.metadata["instanceId"] = request.decode.instance_id
                await errors.abort_with_error(context, error)
            yield prefill_pb2.PrefillResponse(
                first_token=prefill_pb2.FirstToken(token_id=first, index=index)
            )
            if _ends(first, sampling, index):
                await decode.ReleaseLease(decode_pb2.ReleaseLeaseRequest(lease_id=lease_id))
                lease_id = ""
                yield prefill_pb2.PrefillResponse(
                    finished=common_pb2.Finished(
                        finish_reason=_ends(first, sampling, index),
                        usage=common_pb2.Usage(
                            num_prompt_tokens=num_prompt, num_completion_tokens=index + 1
                        ),
                    )
                )
                return
            while self.knobs.hold_before_handoff:
                await asyncio.sleep(0.01)
            yield prefill_pb2.PrefillResponse(
                handed_off=prefill_pb2.HandedOff(
                    lease_id=lease_id,
                    decode_instance_id=request.decode.instance_id,
                    transport="grpc",
                )
            )
            lease_id = ""
        finally:
            # NOTE: contract: a failed or aborted prefill releases its decode lease.
            task = asyncio.get_running_loop().create_task(_release_and_close(channel, lease_id))
            _background.add(task)
            task.add_done_callback(_background.discard)

    async def AbortRequest(
        self, request: prefill_pb2.AbortRequestRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.AbortRequestResponse:
        return prefill_pb2.AbortRequestResponse(was_known=True)

    async def GetModelInfo(
        self, request: prefill_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.GetModelInfoResponse:
        self.num_model_info_calls += 1
        return prefill_pb2.GetModelInfoResponse(
            model_name=MODEL_NAME,
            tokenizer_json=self.tokenizer_json,
            tokenizer_config_json=json.dumps(self.tokenizer_config),
            chat_template=self.chat_template,
            eos_token_ids=[EOS_TOKEN_ID],
            max_model_len=self.max_model_len,
            kv_layout=self.layout,
            instance=self.info(),
        )


TOKENIZER_JSON = tokenizer_json()
_background: set[asyncio.Task[None]] = set()


async def _release_and_close(channel: grpc.aio.Channel, lease_id: str) -> None:
    try:
        if lease_id:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            await stub.ReleaseLease(decode_pb2.ReleaseLeaseRequest(lease_id=lease_id), timeout=2.0)
    except grpc.aio.AioRpcError:
        pass
    finally:
        await channel.close()


class _InstanceStatus(instance_pb2_grpc.InstanceServiceServicer):
    def __init__(self, instance: FakeInstance) -> None:
        self._instance = instance

    async def GetInstanceStatus(
        self, request: instance_pb2.GetInstanceStatusRequest, context: grpc.aio.ServicerContext
    ) -> instance_pb2.GetInstanceStatusResponse:
        return instance_pb2.GetInstanceStatusResponse(
            instance=self._instance.info(), load=self._instance.load()
        )


async def start_instance(instance: FakePrefill | FakeDecode) -> FakePrefill | FakeDecode:
    """Serves a fake (plus InstanceService, health, reflection) on 127.0.0.1 port 0."""
    server = new_aio_server()
    if isinstance(instance, FakePrefill):
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(instance, server)
        name = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
    else:
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(instance, server)
        name = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
    instance_pb2_grpc.add_InstanceServiceServicer_to_server(_InstanceStatus(instance), server)
    await add_standard_services(server, [name])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    instance.server = server
    instance.address = f"127.0.0.1:{port}"
    return instance


async def register(
    gateway_internal_address: str, instance: FakeInstance
) -> registry_pb2.RegisterResponse:
    """Registers a fake at a gateway over RegistryService, as a real instance does."""
    async with insecure_channel(gateway_internal_address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        return await stub.Register(
            registry_pb2.RegisterRequest(instance=instance.info(), load=instance.load())
        )


async def heartbeat(
    gateway_internal_address: str, instance: FakeInstance
) -> registry_pb2.HeartbeatResponse:
    """Sends one heartbeat with the fake's current load."""
    async with insecure_channel(gateway_internal_address) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        return await stub.Heartbeat(
            registry_pb2.HeartbeatRequest(instance_id=instance.instance_id, load=instance.load())
        )
