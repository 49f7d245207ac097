"""Named API keys at the edge: the key file and $PDSERVE_API_KEYS, rotation without a restart,
per-key rate limits (429 + Retry-After, RESOURCE_EXHAUSTED + RetryInfo) and concurrency, and
the key's name (never the key) in logs and spans."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from support.eventually import eventually
from support.gateway_cluster import Cluster
from support.gateway_fakes import MODEL_NAME

from pdserve.common import env, telemetry
from pdserve.common.errors import ErrorReason, PdserveError, from_rpc_error
from pdserve.common.grpc_server import insecure_channel
from pdserve.common.logging import configure_logging
from pdserve.gateway import streaming
from pdserve.gateway.access.admission import RateLimiter
from pdserve.gateway.access.api_keys import ApiKey, ApiKeyStore, key_digest, parse_api_keys
from pdserve.gateway.access.auth import Caller
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc

COMPLETIONS = "/v1/completions"
ALICE = "sk-alice-7f3a9c"
BOB = "sk-bob-0d41e2"
CAROL = "sk-carol-55b6aa"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _grpc_request() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        model=MODEL_NAME, text="x", sampling=common_pb2.SamplingParams(max_tokens=2)
    )


async def _grpc_generate(cluster: Cluster, key: str) -> list[generation_pb2.GenerateResponse]:
    async with insecure_channel(cluster.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        call = stub.Generate(_grpc_request(), metadata=(("authorization", f"Bearer {key}"),))
        return [response async for response in call]


async def _grpc_refusal(cluster: Cluster, key: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await _grpc_generate(cluster, key)
    return raised.value


@pytest.fixture(autouse=True)
def _no_env_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.ENV_API_KEYS, raising=False)


# --- the file format -------------------------------------------------------------------------


def test_key_file_has_names_keys_limits_comments_and_blank_lines() -> None:
    text = f"\n# production keys\nalice:{ALICE}\n\n  bob:{BOB}:rpm=30:concurrency=4  \r\n#x:y\n"
    keys = parse_api_keys(text, "keys.txt")
    assert keys == (
        ApiKey("alice", key_digest(ALICE)),
        ApiKey("bob", key_digest(BOB), requests_per_minute=30.0, max_concurrent_requests=4),
    )
    assert ALICE not in repr(keys) and BOB not in repr(keys)


BAD_LINES = [
    ("no_colon", f"{ALICE}", "expected NAME:KEY"),
    ("bad_name", f"al ice:{ALICE}", "expected NAME:KEY"),
    ("long_name", f"{'a' * 65}:{ALICE}", "expected NAME:KEY"),
    ("empty_key", "alice:", "the key of 'alice' is empty"),
    ("space_in_key", f"alice:{ALICE} {BOB}", "the key of 'alice'"),
    ("unknown_option", f"alice:{ALICE}:{BOB}", "unknown or repeated option"),
    ("repeated_option", f"alice:{ALICE}:rpm=1:rpm=2", "unknown or repeated option"),
    ("zero_rpm", f"alice:{ALICE}:rpm=0", "rpm of 'alice' must be a positive number"),
    ("bad_concurrency", f"alice:{ALICE}:concurrency=1.5", "concurrency of 'alice' must be"),
]


@pytest.mark.parametrize(("name", "line", "message"), BAD_LINES, ids=[c[0] for c in BAD_LINES])
def test_malformed_line_is_refused_naming_its_line_never_its_text(
    name: str, line: str, message: str
) -> None:
    text = f"# keys\ncarol:{CAROL}\n\n{line}\n"
    with pytest.raises(ValueError, match=r"keys\.txt line 4: ") as raised:
        parse_api_keys(text, "keys.txt")
    assert message in str(raised.value)
    for secret in (ALICE, BOB, CAROL):
        assert secret not in str(raised.value)


def test_a_name_or_a_key_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="the key name 'alice' is given twice"):
        parse_api_keys(f"alice:{ALICE}\nalice:{BOB}", "keys.txt")
    with pytest.raises(ValueError, match="'alice' and 'bob' have the same key"):
        parse_api_keys(f"alice:{ALICE}\nbob:{ALICE}", "keys.txt")


def test_env_keys_are_separated_by_commas_or_newlines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.ENV_API_KEYS, f"alice:{ALICE}, bob:{BOB}:rpm=5\ncarol:{CAROL},")
    store = ApiKeyStore.from_settings("kd", None, env.api_keys())
    assert store.names == ("default", "alice", "bob", "carol")
    assert not store.is_open
    assert store.match(BOB) == ApiKey("bob", key_digest(BOB), requests_per_minute=5.0)
    assert store.match("kd") == ApiKey("default", key_digest("kd"))
    assert store.match("nope") is None
    monkeypatch.setenv(env.ENV_API_KEYS, f"alice:{ALICE},bob")
    with pytest.raises(ValueError, match="PDSERVE_API_KEYS entry 2: expected NAME:KEY"):
        ApiKeyStore.from_settings(None, None, env.api_keys())
    monkeypatch.setenv(env.ENV_API_KEYS, " ")
    assert env.api_keys() is None
    assert ApiKeyStore.from_settings(None, None, env.api_keys()).is_open


def test_a_missing_or_malformed_key_file_fails_the_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--api-key-file .*missing\.txt: No such file"):
        ApiKeyStore.from_settings(None, str(tmp_path / "missing.txt"), None)
    path = tmp_path / "keys.txt"
    path.write_text(f"alice:{ALICE}\nbroken\n")
    with pytest.raises(ValueError, match=r"keys\.txt line 2"):
        ApiKeyStore.from_settings(None, str(path), None)
    path.write_text(f"default:{ALICE}\n")
    with pytest.raises(ValueError, match="'default' is given twice"):
        ApiKeyStore.from_settings("kd", str(path), None)
    path.write_text("# nobody yet\n")
    empty = ApiKeyStore.from_settings(None, str(path), None)
    assert not empty.is_open and empty.match(ALICE) is None  # a key file never opens the gateway


async def test_every_source_works_over_rest_and_grpc(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"carol:{CAROL}\n")
    monkeypatch.setenv(env.ENV_API_KEYS, f"bob:{BOB}")
    await cluster.start_gateway(api_key=ALICE, api_key_file=str(path))
    await cluster.add_prefill()
    await cluster.add_decode()
    async with cluster.http() as http:
        for key in (ALICE, BOB, CAROL):
            response = await http.post(
                COMPLETIONS,
                json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
                headers=_bearer(key),
            )
            assert response.status_code == 200, response.text
        assert (await http.get("/v1/models", headers=_bearer("sk-nope"))).status_code == 401
    for key in (ALICE, BOB, CAROL):
        assert (await _grpc_generate(cluster, key))[-1].usage.num_completion_tokens == 2
    assert (await _grpc_refusal(cluster, "sk-nope")).code() == grpc.StatusCode.UNAUTHENTICATED


# --- rotation --------------------------------------------------------------------------------


async def test_key_file_is_reread_without_a_restart(cluster: Cluster, tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    gateway = await cluster.start_gateway(api_key_file=str(path))
    await cluster.add_prefill()
    await cluster.add_decode()
    async with cluster.http() as http:

        async def status(key: str) -> int:
            return (await http.get("/v1/models", headers=_bearer(key))).status_code

        assert (await status(ALICE), await status(BOB), await status(CAROL)) == (200, 200, 401)
        # a stream running across the rotation is not cut
        stream = await cluster.openai(BOB).completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=3, stream=True
        )

        # malformed: the last good set stays, and the error is logged once
        with structlog.testing.capture_logs() as logs:
            path.write_text(f"alice:{ALICE}\nbroken line\ncarol:{CAROL}\n")
            await asyncio.sleep(1.1)
            assert (await status(ALICE), await status(BOB), await status(CAROL)) == (200, 200, 401)
        errors = [e for e in logs if e["event"] == "api_key_file_invalid"]
        assert len(errors) == 1 and "line 2" in errors[0]["error"]
        assert errors[0]["kept"] == ("alice", "bob")

        # bob removed, carol added: bob fails on new requests once the file is looked at again
        # (at the first request a reload interval after the last look; no wall-clock bound
        # here: on a busy machine the requests that trigger it come late)
        path.write_text(f"alice:{ALICE}\ncarol:{CAROL}\n")

        async def is_bob_refused() -> bool:
            return await status(BOB) == 401

        await eventually(is_bob_refused, timeout_s=30, what="bob's key refused")
        assert (await status(ALICE), await status(CAROL)) == (200, 200)
        assert gateway.api_keys.names == ("alice", "carol")
        assert [c async for c in stream][-1].choices[0].finish_reason == "length"


# --- per-key limits --------------------------------------------------------------------------


def test_token_bucket_refills_at_the_key_rate() -> None:
    now = [100.0]
    limiter = RateLimiter(requests_per_minute=2, clock=lambda: now[0])
    alice = Caller(ApiKey("alice", key_digest(ALICE)), "key:alice")
    fast = Caller(ApiKey("fast", key_digest(BOB), requests_per_minute=600), "key:fast")
    limiter.acquire(alice)
    limiter.acquire(alice)  # a burst of a minute's worth
    with pytest.raises(PdserveError) as raised:
        limiter.acquire(alice)
    assert raised.value.reason is ErrorReason.RATE_LIMITED
    assert raised.value.retry_delay_s == pytest.approx(30.0)
    now[0] += 20.0
    with pytest.raises(PdserveError) as raised:
        limiter.acquire(alice)
    assert raised.value.retry_delay_s == pytest.approx(10.0)
    now[0] += 10.0
    limiter.acquire(alice)
    for _ in range(600):
        limiter.acquire(fast)  # its own rpm=600 replaces the gateway's 2
    unlimited = RateLimiter(None)
    for _ in range(1000):
        unlimited.acquire(alice)


async def test_rate_limit_per_key_is_429_with_retry_after_and_resource_exhausted(
    cluster: Cluster, tmp_path: Path
) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"alice:{ALICE}\nbob:{BOB}\ncarol:{CAROL}:rpm=3\n")
    await cluster.start_gateway(api_key_file=str(path), requests_per_minute_per_key=1)
    prefill = await cluster.add_prefill()
    await cluster.add_decode()
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    async with cluster.http() as http:
        assert (await http.post(COMPLETIONS, json=body, headers=_bearer(ALICE))).status_code == 200
        refused = await http.post(COMPLETIONS, json=body, headers=_bearer(ALICE))
        assert refused.status_code == 429
        assert 58 <= int(refused.headers["retry-after"]) <= 60
        error = refused.json()["error"]
        assert (error["code"], error["type"]) == ("rate_limited", "rate_limit_error")
        assert "1 requests a minute" in error["message"]
        statuses = [
            (await http.post(COMPLETIONS, json=body, headers=_bearer(CAROL))).status_code
            for _ in range(4)
        ]
        assert statuses == [200, 200, 200, 429]
    assert (await _grpc_generate(cluster, BOB))[-1].usage.num_completion_tokens == 2
    for key in (BOB, ALICE):  # one bucket per key, shared by REST and gRPC
        rpc_error = await _grpc_refusal(cluster, key)
        assert rpc_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        refusal = from_rpc_error(rpc_error)
        assert refusal.reason is ErrorReason.RATE_LIMITED
        assert refusal.retry_delay_s is not None and 55 < refusal.retry_delay_s <= 60
    assert len(prefill.requests) == 5  # refused requests never reached an instance


async def test_concurrency_is_counted_per_key_name_with_its_own_limit(
    cluster: Cluster, tmp_path: Path
) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"alice:{ALICE}:concurrency=1\nbob:{BOB}\n")
    gateway = await cluster.start_gateway(api_key_file=str(path), max_concurrent_requests_per_key=2)
    prefill = await cluster.add_prefill()
    await cluster.add_decode()
    prefill.knobs.hold_before_handoff = True
    held = [
        await cluster.openai(key).completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=3, stream=True
        )
        for key in (ALICE, BOB, BOB)
    ]
    assert gateway.limiter.num_in_flight == 3
    for key in (ALICE, BOB):  # alice at her own 1, bob at the gateway's 2 per key
        rpc_error = await _grpc_refusal(cluster, key)
        assert rpc_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "for this API key" in from_rpc_error(rpc_error).message
    prefill.knobs.hold_before_handoff = False
    for stream in held:
        assert [c async for c in stream][-1].choices[0].finish_reason == "length"
    await eventually(lambda: gateway.limiter.num_in_flight == 0)


# --- the key's name in spans and logs, never the key -----------------------------------------


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Spans of ``gateway.request``, recorded by a provider of this test alone."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(streaming, "_tracer", provider.get_tracer("pdserve.gateway"))
    yield exporter
    provider.shutdown()


async def test_request_span_carries_the_key_name(
    cluster: Cluster, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"alice:{ALICE}\nbob:{BOB}\n")
    await cluster.start_gateway(api_key_file=str(path))
    await cluster.add_prefill()
    await cluster.add_decode()
    await cluster.openai(ALICE).completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    await _grpc_generate(cluster, BOB)
    await eventually(lambda: len(spans.get_finished_spans()) == 2)
    attributes = [dict(span.attributes or {}) for span in spans.get_finished_spans()]
    assert [a[telemetry.API_KEY_NAME] for a in attributes] == ["alice", "bob"]
    for values in attributes:
        assert not any(key in str(values) for key in (ALICE, BOB))


async def test_the_key_never_reaches_the_logs(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("gateway", "debug")
    try:
        path = tmp_path / "keys.txt"
        path.write_text(f"alice:{ALICE}\n")
        await cluster.start_gateway(api_key_file=str(path), requests_per_minute_per_key=2)
        await cluster.add_prefill()
        await cluster.add_decode()
        async with cluster.http() as http:
            for key in (ALICE, ALICE, ALICE, BOB):  # ok, ok, 429, 401
                await http.post(
                    COMPLETIONS,
                    json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2},
                    headers=_bearer(key),
                )
            await http.post(
                COMPLETIONS, json={"model": MODEL_NAME, "prompt": ""}, headers=_bearer(ALICE)
            )
            # a rotation to a file whose bad line is a bare key: the error names the line only
            path.write_text(f"alice:{ALICE}\n{BOB}\n")
            await asyncio.sleep(1.1)
            await http.get("/v1/models", headers=_bearer(ALICE))
    finally:
        structlog.reset_defaults()
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert '"event": "request_finished"' in output and '"api_key_name": "alice"' in output
    assert "api_key_file_invalid" in output and "line 2" in output
    for key in (ALICE, BOB):
        assert key not in output
