"""Who may write into or release a lease, and how much one peer may lease: a real decode server
fed real KV, with the caller's mTLS identity set per call (`peer_identity` patched where the
servicer reads it; None is a plaintext caller)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import grpc
import pytest
import structlog
from support.decode_harness import BLOCK_SIZE, DecodeClient, Prefilled, tokens_of
from support.eventually import eventually

from pdserve.common import errors
from pdserve.common.errors import ErrorReason
from pdserve.common.generation import SamplingParams
from pdserve.common.pki import Identity
from pdserve.decode import servicer as servicer_module
from pdserve.decode.config import DecodeConfig
from pdserve.decode.lease_state import RequestStatus
from pdserve.prefill.convert import lease_from_proto
from pdserve.serving.convert import local_protocol
from pdserve.v1 import decode_pb2

PROMPT = [5, 17, 42, 99, 7, 63, 120, 33, 8, 250, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PREFILL_A = Identity("prefill", "prefill-a")
PREFILL_B = Identity("prefill", "prefill-b")
GATEWAY = Identity("gateway", "gateway-0")
DENIED = ErrorReason.PERMISSION_DENIED


@pytest.fixture
def caller(monkeypatch: pytest.MonkeyPatch) -> Callable[[Identity | None], None]:
    """Sets whose certificate the next calls arrive with (None: plaintext)."""
    current: list[Identity | None] = [None]
    monkeypatch.setattr(servicer_module, "peer_identity", lambda context: current[0])

    def set_caller(identity: Identity | None) -> None:
        current[0] = identity

    return set_caller


def _secure(client: DecodeClient, is_secure: bool) -> None:
    client.instance.leases.is_insecure = not is_secure


async def _expect_error(awaitable, reason: ErrorReason) -> errors.PdserveError:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await awaitable
    error = errors.from_rpc_error(caught.value)
    assert error.reason is reason, error
    return error


async def _allocate(
    client: DecodeClient, request_id: str, num_tokens: int, max_new_tokens: int, prefill: str = ""
) -> decode_pb2.Lease:
    response = await client.decode.AllocateBlocks(
        decode_pb2.AllocateBlocksRequest(
            request_id=request_id,
            num_prompt_tokens=num_tokens,
            max_new_tokens=max_new_tokens,
            kv_layout=client.local.host.kv_layout,
            protocol=local_protocol(),
            prefill_instance_id=prefill,
        )
    )
    return response.lease


def _token(lease: decode_pb2.Lease) -> bytes:
    return lease_from_proto(lease).transport_token


def _tokens(kind: str, lease: decode_pb2.Lease) -> bytes:
    """The token a call presents: the lease's, another one of the same length, or none."""
    right = _token(lease)
    return {"right": right, "wrong": bytes(b ^ 0x5A for b in right), "none": b""}[kind]


def _leaks(token: bytes, text: str) -> bool:
    return token.hex() in text or repr(token)[2:-1] in text


def _state(client: DecodeClient, lease: decode_pb2.Lease) -> tuple[RequestStatus, int]:
    request = client.instance.leases.table.get(lease.lease_id)
    return request.status, len(request.block_ids)


async def _generates_reference(client: DecodeClient, prefilled: Prefilled, lease_id: str) -> None:
    reference = client.local.reference(PROMPT, prefilled.sampling)
    ids, _ = tokens_of(await client.collect(lease_id, prefilled.request_id))
    assert [prefilled.first_token_id, *ids] == reference


async def test_a_lease_token_is_unguessable_and_stays_out_of_reprs(client: DecodeClient) -> None:
    leases = client.instance.leases
    first, second = (leases.allocate(f"r{i}", 8, 4) for i in range(2))
    assert len(first.lease_token) == 32 and first.lease_token != second.lease_token
    assert first.lease_token not in repr(first).encode()
    assert first.lease_token.hex() not in repr(first)
    grant = dataclasses.replace(lease_from_proto(decode_pb2.Lease()), transport_token=b"secret")
    assert "secret" not in repr(grant)
    for lease in (first, second):
        leases.table.end(lease, RequestStatus.ABORTED)


class _SlowSteps:
    """Delegates to the decode's runner, sleeping before every step (a stream that lasts)."""

    def __init__(self, runner: object, delay_s: float) -> None:
        self._runner = runner
        self.delay_s = delay_s

    def __getattr__(self, name: str) -> object:
        return getattr(self._runner, name)

    def execute(self, *args: object, **kwargs: object) -> object:
        time.sleep(self.delay_s)
        return self._runner.execute(*args, **kwargs)  # type: ignore[attr-defined]


# ---- SyncCache ---------------------------------------------------------------------------

# (allocated by, writer, secure plane, token presented, refused?)
SYNC_CASES = {
    "plaintext-right-token": (None, None, False, "right", False),
    "plaintext-wrong-token": (None, None, False, "wrong", True),
    "plaintext-no-token": (None, None, False, "none", True),
    "mtls-owner-right-token": (PREFILL_A, PREFILL_A, True, "right", False),
    "mtls-owner-wrong-token": (PREFILL_A, PREFILL_A, True, "wrong", True),
    "mtls-other-prefill-right-token": (PREFILL_A, PREFILL_B, True, "right", True),
    "mtls-no-identity-right-token": (PREFILL_A, None, True, "right", True),
}


@pytest.mark.parametrize(
    ("allocator", "writer", "is_secure", "token", "is_refused"),
    SYNC_CASES.values(),
    ids=SYNC_CASES.keys(),
)
async def test_sync_cache_needs_the_lease_token_and_a_refusal_leaves_the_lease(
    client: DecodeClient,
    caller: Callable[[Identity | None], None],
    allocator: Identity | None,
    writer: Identity | None,
    is_secure: bool,
    token: str,
    is_refused: bool,
) -> None:
    _secure(client, is_secure)
    prefilled = client.local.prefill("sync", PROMPT, GREEDY)
    caller(allocator)
    lease = await client.allocate(prefilled)
    before = _state(client, lease)
    caller(writer)
    with structlog.testing.capture_logs() as logs:
        if is_refused:
            await _expect_error(client.sync(prefilled, lease, _tokens(token, lease)), DENIED)
        else:
            await client.sync(prefilled, lease, _tokens(token, lease))
    if is_refused:
        assert _state(client, lease) == before == (RequestStatus.ALLOCATED, before[1])
        assert client.instance.leases.num_access_refused == 1
        refused = [e for e in logs if e["event"] == "lease_access_refused"]
        assert refused and refused[0]["num_refused"] == 1 and refused[0]["rpc"] == "SyncCache"
        # The lease is still usable by its owner, with its token.
        caller(allocator)
        await client.sync(prefilled, lease)
    client.local.free(prefilled)
    assert not any(_leaks(_token(lease), str(event)) for event in logs)
    await _generates_reference(client, prefilled, lease.lease_id)
    await client.assert_whole()


async def _end_lease(client: DecodeClient, prefilled: Prefilled, how: str) -> decode_pb2.Lease:
    lease = await client.allocate(prefilled)
    if how == "commit":
        await client.sync(prefilled, lease)
    elif how == "release":
        await client.decode.ReleaseLease(
            decode_pb2.ReleaseLeaseRequest(
                lease_id=lease.lease_id, request_id=prefilled.request_id, lease_token=_token(lease)
            )
        )
    elif how == "failure":
        messages = list(client.local.sync_messages(prefilled, lease))
        await _expect_error(
            client.decode.SyncCache(iter(messages[:2])), ErrorReason.CACHE_SYNC_FAILED
        )
    elif how == "expiry":
        leases = client.instance.leases
        leases.table.get(lease.lease_id).expires_at = 0.0  # NOTE: the sweeper runs every 0.5 s
        await eventually(lambda: leases.table.num_expired == 1, 30, "the lease expiring")
    return lease


# how the lease ended -> what a second SyncCache with its (right) token gets
REUSE_CASES = {
    "commit": DENIED,  # still open (running): the token is void
    "release": ErrorReason.LEASE_NOT_FOUND,
    "failure": ErrorReason.LEASE_NOT_FOUND,
    "expiry": ErrorReason.LEASE_EXPIRED,
}


@pytest.mark.parametrize(("how", "reason"), REUSE_CASES.items(), ids=REUSE_CASES.keys())
async def test_a_token_is_void_once_its_lease_left_allocated(
    client: DecodeClient, how: str, reason: ErrorReason
) -> None:
    # NOTE: slow enough that the committed request still runs when the token comes back.
    client.instance.loop.runner = _SlowSteps(client.instance.loop.runner, 0.01)  # type: ignore[assignment]
    sampling = dataclasses.replace(GREEDY, max_tokens=100)
    prefilled = client.local.prefill(f"reuse-{how}", PROMPT, sampling)
    lease = await _end_lease(client, prefilled, how)
    await _expect_error(client.sync(prefilled, lease), reason)
    client.local.free(prefilled)
    if how == "commit":
        await _generates_reference(client, prefilled, lease.lease_id)
    await client.assert_whole()


# ---- ReleaseLease ------------------------------------------------------------------------

# (secure plane, releaser, request id matches, token presented, allowed?)
RELEASE_CASES = {
    "wrong-request-id-with-token": (False, None, False, "right", False),
    "mtls-gateway-wrong-request-id": (True, GATEWAY, False, "none", False),
    "plaintext-request-id-only": (False, None, True, "none", True),
    "plaintext-wrong-token-request-id": (False, None, True, "wrong", True),
    "plaintext-token": (False, None, True, "right", True),
    "mtls-owner-no-token": (True, PREFILL_A, True, "none", True),
    "mtls-gateway-no-token": (True, GATEWAY, True, "none", True),
    "mtls-other-prefill-token": (True, PREFILL_B, True, "right", True),
    "mtls-other-prefill-no-token": (True, PREFILL_B, True, "none", False),
    "mtls-other-prefill-wrong-token": (True, PREFILL_B, True, "wrong", False),
    "mtls-no-identity-no-token": (True, None, True, "none", False),
}


@pytest.mark.parametrize(
    ("is_secure", "releaser", "is_own_request", "token", "is_allowed"),
    RELEASE_CASES.values(),
    ids=RELEASE_CASES.keys(),
)
async def test_release_lease_rules(
    client: DecodeClient,
    caller: Callable[[Identity | None], None],
    is_secure: bool,
    releaser: Identity | None,
    is_own_request: bool,
    token: str,
    is_allowed: bool,
) -> None:
    _secure(client, is_secure)
    caller(PREFILL_A if is_secure else None)
    lease = await _allocate(client, "rel", 40, 4)
    before = _state(client, lease)
    caller(releaser)
    release = decode_pb2.ReleaseLeaseRequest(
        lease_id=lease.lease_id,
        request_id="rel" if is_own_request else "someone-else",
        lease_token=_tokens(token, lease),
    )
    if is_allowed:
        response = await client.decode.ReleaseLease(release)
        assert response.state == decode_pb2.LEASE_STATE_ABORTED
    else:
        await _expect_error(client.decode.ReleaseLease(release), DENIED)
        assert _state(client, lease) == before
        caller(PREFILL_A if is_secure else None)
        release.request_id, release.lease_token = "rel", _token(lease)
        await client.decode.ReleaseLease(release)
    await client.assert_whole()


async def test_a_release_for_another_request_does_not_stop_a_live_stream(
    client: DecodeClient,
) -> None:
    sampling = dataclasses.replace(GREEDY, max_tokens=100)
    reference = client.local.reference(PROMPT, sampling)
    client.instance.loop.runner = _SlowSteps(client.instance.loop.runner, 0.01)  # type: ignore[assignment]
    prefilled = client.local.prefill("live", PROMPT, sampling)
    lease = await client.allocate(prefilled)
    await client.sync(prefilled, lease)
    client.local.free(prefilled)
    stream = asyncio.create_task(client.collect(lease.lease_id, "live"))
    await eventually(
        lambda: client.instance.leases.table.get(lease.lease_id).is_attached, 30, "attach"
    )
    stranger = decode_pb2.ReleaseLeaseRequest(lease_id=lease.lease_id, request_id="not-live")
    await _expect_error(client.decode.ReleaseLease(stranger), DENIED)
    ids, _ = tokens_of(await stream)
    assert [prefilled.first_token_id, *ids] == reference
    await client.assert_whole()


# ---- AllocateBlocks ----------------------------------------------------------------------

# (num_prompt_tokens, max_new_tokens) against the tiny model's max_model_len of 512
LENGTH_CASES = {"fits-exactly": (500, 12), "one-over": (500, 13), "64x": (64 * 512, 1)}


class TestModelLength:
    @pytest.fixture
    def decode_config(self) -> DecodeConfig:
        # Room for a whole 500-token prompt, held by one peer.
        return DecodeConfig(
            port=0, block_size=BLOCK_SIZE, num_blocks=160, max_lease_share=1.0, insecure=True
        )

    @pytest.mark.parametrize(
        ("num_tokens", "max_new"), LENGTH_CASES.values(), ids=LENGTH_CASES.keys()
    )
    async def test_allocation_past_max_model_len_is_prompt_too_long(
        self, client: DecodeClient, num_tokens: int, max_new: int
    ) -> None:
        assert client.instance.host.max_model_len == 512
        if num_tokens + max_new <= 512:
            lease = await _allocate(client, "len", num_tokens, max_new, "prefill-a")
            await client.decode.ReleaseLease(
                decode_pb2.ReleaseLeaseRequest(lease_id=lease.lease_id, request_id="len")
            )
        else:
            error = await _expect_error(
                _allocate(client, "len", num_tokens, max_new), ErrorReason.PROMPT_TOO_LONG
            )
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert f"({num_tokens})" in error.message and f"({max_new})" in error.message
            assert "512" in error.message
        await client.assert_whole()


@pytest.mark.parametrize("is_secure", [False, True], ids=["by-instance-id", "by-identity"])
async def test_one_peer_holds_at_most_its_share_until_it_commits(
    client: DecodeClient, caller: Callable[[Identity | None], None], is_secure: bool
) -> None:
    # 64 blocks, share 0.5: 32 blocks per peer in leases not yet committed. Each prompt of 40
    # tokens takes 10 blocks. With mTLS the certificate is the peer, whatever id it states.
    _secure(client, is_secure)
    caller(PREFILL_A if is_secure else None)
    sampling = dataclasses.replace(GREEDY, max_tokens=2)
    prompts = [[(11 * i + j) % 300 + 3 for j in range(40)] for i in range(4)]
    prefilled = [client.local.prefill(f"a{i}", p, sampling) for i, p in enumerate(prompts)]
    leases = [
        await _allocate(client, f"a{i}", 40, 2, "prefill-a" if not is_secure else f"id-{i}")
        for i in range(3)
    ]
    # Alone, a peer may use the whole pool: the share applies while others ask too.
    alone = await _allocate(client, "a-alone", 4, 2, "prefill-a" if not is_secure else "id-9")
    await client.decode.ReleaseLease(
        decode_pb2.ReleaseLeaseRequest(lease_id=alone.lease_id, request_id="a-alone")
    )
    caller(PREFILL_B if is_secure else None)
    other = await _allocate(client, "b0", 40, 2, "prefill-b")
    caller(PREFILL_A if is_secure else None)
    fourth = _allocate(client, "a3", 40, 2, "prefill-a" if not is_secure else "id-3")
    error = await _expect_error(fourth, ErrorReason.DECODE_CAPACITY_EXHAUSTED)
    assert error.retry_delay_s == pytest.approx(0.2)
    assert "30" in error.message and "32" in error.message
    assert error.metadata["limit"] == "peer_share"
    # A commit frees the share it used.
    await client.sync(prefilled[0], leases[0])
    await client.collect(leases[0].lease_id, "a0")
    leases.append(await _allocate(client, "a3", 40, 2, "prefill-a" if not is_secure else "id-3"))
    await client.sync(prefilled[3], leases[3])
    await client.collect(leases[3].lease_id, "a3")
    for p in prefilled:
        client.local.free(p)
    for i, lease in ((1, leases[1]), (2, leases[2])):
        release = decode_pb2.ReleaseLeaseRequest(lease_id=lease.lease_id, request_id=f"a{i}")
        await client.decode.ReleaseLease(release)
    release = decode_pb2.ReleaseLeaseRequest(lease_id=other.lease_id, request_id="b0")
    caller(GATEWAY if is_secure else None)
    await client.decode.ReleaseLease(release)
    await client.assert_whole()


async def test_a_peers_only_lease_may_exceed_the_share(client: DecodeClient) -> None:
    # 64 blocks, share 0.5 (32), another peer asking too: one 35-block lease alone is granted
    # (the model length bounds it), but nothing more until it commits or ends.
    other = await _allocate(client, "other", 4, 2, "prefill-d")
    await client.decode.ReleaseLease(
        decode_pb2.ReleaseLeaseRequest(lease_id=other.lease_id, request_id="other")
    )
    big = await _allocate(client, "big", 140, 2, "prefill-c")
    assert len(big.block_ids) == 35
    await _expect_error(
        _allocate(client, "small", 4, 2, "prefill-c"), ErrorReason.DECODE_CAPACITY_EXHAUSTED
    )
    release = decode_pb2.ReleaseLeaseRequest(lease_id=big.lease_id, request_id="big")
    await client.decode.ReleaseLease(release)
    small = await _allocate(client, "small", 4, 2, "prefill-c")
    release = decode_pb2.ReleaseLeaseRequest(lease_id=small.lease_id, request_id="small")
    await client.decode.ReleaseLease(release)
    await client.assert_whole()


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_max_lease_share_must_be_a_fraction(share: float) -> None:
    with pytest.raises(ValueError, match="max_lease_share"):
        DecodeConfig(max_lease_share=share, insecure=True)
