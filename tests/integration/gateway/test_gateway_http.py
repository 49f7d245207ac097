"""Edges of the REST and gRPC front ends: content type, exact paths, request ids, unexpected
exceptions, keep-alive connections after errors, and gRPC messages that do not parse."""

from __future__ import annotations

import asyncio
import http.client
from typing import Any

import grpc
import pytest
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME

from pdserve.common.errors import ErrorReason, from_rpc_error, has_error_info
from pdserve.common.grpc_server import insecure_channel
from pdserve.v1 import common_pb2, generation_pb2

COMPLETIONS = "/v1/completions"
GOOD = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
GENERATE = "/pdserve.v1.GenerationService/Generate"


ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 415: "invalid_request_error"}


def _assert_openai_error(body: Any, status: int, code: str) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == code
    assert error["type"] == ERROR_TYPES.get(status, "server_error")


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx"]
)
async def test_generation_requires_a_json_content_type(
    pd: Cluster, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    async with pd.http() as http:
        response = await http.post(COMPLETIONS, content=GOOD, headers=headers)
        assert response.status_code == 415
        _assert_openai_error(response.json(), 415, "unsupported_media_type")
        ok = await http.post(
            COMPLETIONS, content=GOOD, headers={"content-type": "Application/JSON; charset=utf-8"}
        )
        assert ok.status_code == 200
    assert len(pd.prefills[0].requests) == 1


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/completions/"), ("POST", "/v1/chat/completions/"), ("GET", "/v1/models/"),
     ("GET", "/health/"), ("GET", "/v2/completions")],
)  # fmt: skip
async def test_paths_are_exact_a_trailing_slash_is_404(pd: Cluster, method: str, path: str) -> None:
    async with pd.http() as http:
        response = await http.request(
            method, path, content=GOOD, headers={"content-type": "application/json"}
        )
    assert response.status_code == 404
    assert "location" not in response.headers
    _assert_openai_error(response.json(), 404, "not_found")


async def test_wrong_method_is_405_with_an_openai_body(pd: Cluster) -> None:
    async with pd.http() as http:
        response = await http.get(COMPLETIONS)
    assert response.status_code == 405
    _assert_openai_error(response.json(), 405, "method_not_allowed")


async def test_every_response_carries_its_request_id(pd: Cluster) -> None:
    async with pd.http() as http:
        ok = await http.post(
            COMPLETIONS, content=GOOD, headers={"content-type": "application/json"}
        )
        bad = await http.post(COMPLETIONS, json={"model": MODEL_NAME, "prompt": ""})
        health = await http.get("/health")
    ids = [r.headers["x-request-id"] for r in (ok, bad, health)]
    assert all(len(i) == 32 for i in ids) and len(set(ids)) == 3
    assert ok.json()["id"] == f"cmpl-{ids[0]}"


async def test_unexpected_exception_is_a_500_openai_body_that_closes_the_connection(
    pd: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = pd.gateway
    assert gateway is not None

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gateway.frontend, "prepare", broken)
    async with pd.http() as http:
        response = await http.post(
            COMPLETIONS, content=GOOD, headers={"content-type": "application/json"}
        )
        assert response.status_code == 500
        _assert_openai_error(response.json(), 500, "internal")
        request_id = response.headers["x-request-id"]
        assert request_id in response.json()["error"]["message"]
        assert response.headers["connection"] == "close"
        monkeypatch.undo()
        ok = await http.post(
            COMPLETIONS, content=GOOD, headers={"content-type": "application/json"}
        )
        assert ok.status_code == 200

    monkeypatch.setattr(gateway.frontend, "prepare", broken)
    request = generation_pb2.GenerateRequest(
        model=MODEL_NAME, text="x", sampling=common_pb2.SamplingParams(max_tokens=2)
    )
    async with insecure_channel(pd.grpc_address) as channel:
        call = channel.unary_stream(GENERATE, request_serializer=lambda m: m.SerializeToString())
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [r async for r in call(request)]
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    assert from_rpc_error(raised.value).reason is ErrorReason.INTERNAL


def _exchange(port: int, requests: list[tuple[str, str, bytes, dict[str, str]]]) -> list[Any]:
    """Sends requests one after another on ONE keep-alive connection (fails if it is dropped)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    answers = []
    try:
        connection.connect()
        sock = connection.sock
        for method, path, body, headers in requests:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            answers.append((response.status, response.read()))
            assert response.getheader("connection") != "close"
            assert connection.sock is sock, "the server closed the connection"
    finally:
        connection.close()
    return answers


async def test_errors_keep_the_keep_alive_connection_usable(cluster: Cluster) -> None:
    await cluster.start_gateway(max_body_bytes=2000)
    await cluster.add_prefill()
    await cluster.add_decode()
    json_type = {"content-type": "application/json"}
    oversized = b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}'
    requests = [
        ("POST", COMPLETIONS, b'{"model": "tiny", "prompt": "\\ud800"}', json_type),
        ("POST", COMPLETIONS, b"[" * 900 + b"]" * 900, json_type),
        ("POST", COMPLETIONS, oversized, json_type),
        ("POST", COMPLETIONS, GOOD, {"content-type": "text/plain"}),
        ("POST", "/v1/completions/", GOOD, json_type),
        ("POST", COMPLETIONS, GOOD, json_type),
    ]
    gateway = cluster.gateway
    assert gateway is not None and gateway.http_port is not None
    answers = await asyncio.to_thread(_exchange, gateway.http_port, requests)
    assert [status for status, _ in answers] == [400, 400, 413, 415, 404, 200]


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xff\xff", b"\x0a\x02\xed\xa0", b"\x12\x05ab"],
    ids=["garbage", "bad_utf8", "truncated"],
)
async def test_grpc_request_that_does_not_parse_is_invalid_argument_with_error_info(
    pd: Cluster, raw: bytes
) -> None:
    async with insecure_channel(pd.grpc_address) as channel:
        call = channel.unary_stream(GENERATE, request_serializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            [r async for r in call(raw)]
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert has_error_info(raised.value)
    assert from_rpc_error(raised.value).reason is ErrorReason.INVALID_REQUEST
    assert pd.prefills[0].requests == []


async def test_grpc_list_models_that_does_not_parse_is_invalid_argument(pd: Cluster) -> None:
    async with insecure_channel(pd.grpc_address) as channel:
        models = channel.unary_unary(
            "/pdserve.v1.GenerationService/ListModels", request_serializer=lambda b: b
        )
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await models(b"\xff\xff\xff")
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(raised.value).reason is ErrorReason.INVALID_REQUEST
