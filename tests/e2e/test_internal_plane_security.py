"""Walks every RPC of every internal service against mutual TLS and the role table.

The RPCs come from the descriptors (`pdserve.v1` plus health and reflection), so a new RPC or
service cannot slip through: it must have a row in `authz.CALLERS` and a server here. Each is
called on a real cluster (gateway, prefill, decode; mTLS under the test CA) by:

* a plaintext caller and a TLS caller without a client certificate: the handshake fails
  (UNAVAILABLE), nothing runs;
* a caller whose certificate comes from another CA (with an allowed role): the same;
* a valid certificate of a role the table does not allow: PERMISSION_DENIED with a pdserve
  ErrorInfo;
* a valid certificate of an allowed role: the call reaches its handler (whatever it answers
  to an empty request, it is not refused by the handshake or the role table).
"""

from __future__ import annotations

import importlib
import itertools
import pkgutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from support.pki import cluster_pki
from support.real_cluster import RealCluster

import pdserve.v1
from pdserve.common import authz, pki
from pdserve.common.errors import ErrorReason, from_rpc_error, has_error_info
from pdserve.serving.convert import local_protocol
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc, registry_pb2, registry_pb2_grpc

MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

# NOTE: GenerationService is the public API on the gateway's other port (API keys, no mTLS).
PUBLIC_SERVICES = {"pdserve.v1.GenerationService"}
SERVERS = {
    "pdserve.v1.PrefillService": ("prefill",),
    "pdserve.v1.DecodeService": ("decode",),
    "pdserve.v1.InstanceService": ("prefill", "decode"),
    "pdserve.v1.RegistryService": ("gateway",),
    "grpc.health.v1.Health": ("prefill", "decode", "gateway"),
    "grpc.reflection.v1alpha.ServerReflection": ("prefill", "decode", "gateway"),
}


# NOTE: the policy, written out a second time on purpose: widening authz.CALLERS must also
# change this table (and be reviewed as a security change).
G, P, D, C = "gateway", "prefill", "decode", "client"
ANY = {G, P, D, C}
INTENDED = {
    "/pdserve.v1.PrefillService/Prefill": {G},
    "/pdserve.v1.PrefillService/AbortRequest": {G},
    "/pdserve.v1.PrefillService/GetModelInfo": {G, C},
    "/pdserve.v1.DecodeService/AllocateBlocks": {P},
    "/pdserve.v1.DecodeService/SyncCache": {P},
    "/pdserve.v1.DecodeService/Generate": {G},
    "/pdserve.v1.DecodeService/ReleaseLease": {P, G},
    "/pdserve.v1.InstanceService/GetInstanceStatus": {G, C},
    "/pdserve.v1.RegistryService/Register": {P, D},
    "/pdserve.v1.RegistryService/Heartbeat": {P, D},
    "/pdserve.v1.RegistryService/Deregister": {P, D},
    "/grpc.health.v1.Health/Check": ANY,
    "/grpc.health.v1.Health/Watch": ANY,
    "/grpc.health.v1.Health/List": ANY,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": ANY,
}


def internal_methods() -> list[MethodDescriptor]:
    """Every RPC of every service in every pdserve.v1 file, plus health and reflection."""
    modules = [
        importlib.import_module(f"pdserve.v1.{info.name}")
        for info in pkgutil.iter_modules(pdserve.v1.__path__)
        if info.name.endswith("_pb2")
    ]
    services = [
        service
        for module in (*modules, health_pb2, reflection_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        if service.full_name not in PUBLIC_SERVICES
    ]
    return [method for service in services for method in service.methods]


METHODS = internal_methods()


def path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def test_every_internal_rpc_has_a_row_and_a_server() -> None:
    # NOTE: a new RPC fails here until it is given callers (authz.CALLERS) and a server.
    assert {name: set(roles) for name, roles in authz.CALLERS.items()} == INTENDED
    for method in METHODS:
        assert path(method) in authz.CALLERS, f"{path(method)} has no row in authz.CALLERS"
        assert method.containing_service.full_name in SERVERS, f"no server for {path(method)}"
    assert len(METHODS) >= 15


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(demo_model_dir: Path) -> AsyncIterator[RealCluster]:
    real = RealCluster(demo_model_dir)
    try:
        yield await real.start()
    finally:
        await real.close()


def address(cluster: RealCluster, server: str) -> str:
    if server == "gateway":
        return cluster.internal_address
    instance = cluster.prefills[0] if server == "prefill" else cluster.decodes[0]
    return instance.address


async def call(channel: grpc.aio.Channel, method: MethodDescriptor) -> grpc.aio.AioRpcError | None:
    """Calls `method` with an empty request (one message on a client stream); the error, or
    None when it answered."""
    request_class = message_factory.GetMessageClass(method.input_type)
    response_class = message_factory.GetMessageClass(method.output_type)
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(method.client_streaming, method.server_streaming)]
    stub: Any = kind(
        path(method),
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )
    request: Any = iter([request_class()]) if method.client_streaming else request_class()
    try:
        rpc = stub(request, timeout=2.0)
        if method.server_streaming:
            async for _ in rpc:
                break
            rpc.cancel()
        else:
            await rpc
    except grpc.aio.AioRpcError as error:
        return error
    return None


def allowed_role(method: MethodDescriptor) -> str:
    return sorted(INTENDED[path(method)])[0]


CASES = [
    (method, server)
    for method in METHODS
    for server in SERVERS.get(method.containing_service.full_name, ())
]
IDS = [f"{server}:{path(method)}" for method, server in CASES]
_serial = itertools.count()


def other_ca_channel(target: str, role: str) -> grpc.aio.Channel:
    """A channel presenting a valid-looking certificate of `role` from a stranger's CA."""
    stranger_ca = pki.new_ca(name="stranger CA")
    pair = pki.issue(stranger_ca, pki.Identity(role, f"{role}-{next(_serial)}"))
    credentials = grpc.ssl_channel_credentials(
        cluster_pki().ca.cert_pem, pair.key_pem, pair.cert_pem
    )
    options = [("grpc.ssl_target_name_override", pki.MEMBER_DNS_NAME)]
    return grpc.aio.secure_channel(target, credentials, options=options)


@MODULE_LOOP
@pytest.mark.parametrize(("method", "server"), CASES, ids=IDS)
async def test_callers_without_a_cluster_certificate_are_refused(
    cluster: RealCluster, method: MethodDescriptor, server: str
) -> None:
    target = address(cluster, server)
    role = allowed_role(method)
    no_client_cert = grpc.ssl_channel_credentials(cluster_pki().ca.cert_pem)
    channels = {
        "plaintext": grpc.aio.insecure_channel(target),
        "no client certificate": grpc.aio.secure_channel(
            target, no_client_cert, options=[("grpc.ssl_target_name_override", pki.MEMBER_DNS_NAME)]
        ),
        "another CA": other_ca_channel(target, role),
    }
    for name, channel in channels.items():
        async with channel:
            error = await call(channel, method)
        assert error is not None, f"{name}: {path(method)} answered"
        assert error.code() == grpc.StatusCode.UNAVAILABLE, f"{name}: {error.code()}"


@MODULE_LOOP
@pytest.mark.parametrize(("method", "server"), CASES, ids=IDS)
async def test_a_role_outside_the_table_is_denied_and_an_allowed_one_gets_through(
    cluster: RealCluster, method: MethodDescriptor, server: str
) -> None:
    target = address(cluster, server)
    for role in sorted(set(pki.ROLES) - INTENDED[path(method)]):
        async with cluster_pki().channel(target, role, f"{role}-walker") as channel:
            error = await call(channel, method)
        assert error is not None, f"{role}: {path(method)} answered"
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, f"{role}: {error.code()}"
        assert has_error_info(error)
        assert from_rpc_error(error).reason is ErrorReason.PERMISSION_DENIED
    role = allowed_role(method)
    async with cluster_pki().channel(target, role, f"{role}-walker") as channel:
        error = await call(channel, method)
    if error is not None:
        assert error.code() != grpc.StatusCode.UNAVAILABLE, error.details()
        assert "may not call" not in (error.details() or ""), error.details()


@MODULE_LOOP
async def test_an_instance_may_only_speak_for_itself(cluster: RealCluster) -> None:
    assert cluster.gateway is not None
    real_decode = cluster.decodes[0].instance
    prefill_id = cluster.prefills[0].instance.instance_id
    load = common_pb2.LoadReport(num_total_blocks=8192, num_free_blocks=8192)
    impostor = common_pb2.InstanceInfo()
    impostor.CopyFrom(real_decode)
    impostor.address = "127.0.0.1:1"
    calls = {
        # a prefill's certificate registering the real decode's id (the hijack)
        "register as another": (
            P, prefill_id, "Register", registry_pb2.RegisterRequest(instance=impostor, load=load)
        ),
        # a decode's certificate registering its own id as a prefill
        "register as another role": (
            D, real_decode.instance_id, "Register",
            registry_pb2.RegisterRequest(
                instance=common_pb2.InstanceInfo(
                    **{**_fields(real_decode), "role": common_pb2.INSTANCE_ROLE_PREFILL}
                ),
                load=load,
            ),
        ),
        "heartbeat for another": (
            P, prefill_id, "Heartbeat",
            registry_pb2.HeartbeatRequest(instance_id=real_decode.instance_id, load=load),
        ),
        "deregister another": (
            P, prefill_id, "Deregister",
            registry_pb2.DeregisterRequest(instance_id=real_decode.instance_id),
        ),
    }  # fmt: skip
    for name, (role, instance_id, rpc, request) in calls.items():
        async with cluster_pki().channel(cluster.internal_address, role, instance_id) as channel:
            stub = registry_pb2_grpc.RegistryServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await getattr(stub, rpc)(request, timeout=5)
        assert from_rpc_error(refused.value).reason is ErrorReason.PERMISSION_DENIED, name
    entry = cluster.gateway.registry.get(real_decode.instance_id)
    assert entry is not None and entry.info.address == real_decode.address


@MODULE_LOOP
async def test_a_prefill_sends_kv_only_to_the_decode_it_was_told(cluster: RealCluster) -> None:
    decode = cluster.decodes[0]
    request = prefill_pb2.PrefillRequest(
        request_id="walker-wrong-decode",
        token_ids=[5, 6, 7, 8],
        sampling=common_pb2.SamplingParams(max_tokens=4),
        # NOTE: the real decode's address under another decode's name: the TLS handshake
        # fails, so no lease is asked for and no KV leaves the prefill.
        decode=prefill_pb2.DecodeTarget(address=decode.address, instance_id="decode-elsewhere"),
        protocol=local_protocol(),
    )
    target = cluster.prefills[0].address
    async with cluster_pki().channel(target, G, "gateway-walker") as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stub.Prefill(request, timeout=10):
                pass
    assert from_rpc_error(refused.value).reason is ErrorReason.PEER_UNAVAILABLE
    await cluster.assert_whole()


def _fields(info: common_pb2.InstanceInfo) -> dict[str, Any]:
    return {field.name: value for field, value in info.ListFields()}
