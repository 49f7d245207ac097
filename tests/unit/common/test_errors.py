from __future__ import annotations

import pickle

import grpc
import pytest

from pdserve.common.errors import REASON_SPECS, ErrorReason, PdserveError, RetryScope


def test_default_code_comes_from_the_contract() -> None:
    error = PdserveError(ErrorReason.DECODE_CAPACITY_EXHAUSTED, "full")
    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.retry_scope is RetryScope.ANOTHER_DECODE
    assert error.http_status == 429
    assert str(error) == "DECODE_CAPACITY_EXHAUSTED: full"


def test_alternative_code_allowed_only_where_the_contract_lists_it() -> None:
    broken = PdserveError(ErrorReason.CACHE_SYNC_FAILED, code=grpc.StatusCode.ABORTED)
    assert broken.code is grpc.StatusCode.ABORTED
    with pytest.raises(ValueError, match="cannot use gRPC code"):
        PdserveError(ErrorReason.INVALID_REQUEST, code=grpc.StatusCode.INTERNAL)


@pytest.mark.parametrize("reason", list(ErrorReason), ids=lambda r: r.name)
def test_client_errors_map_to_4xx_and_never_retry(reason: ErrorReason) -> None:
    spec = REASON_SPECS[reason]
    if spec.retry_scope is RetryScope.NEVER and reason is not ErrorReason.CANCELLED:
        assert 400 <= spec.http_status < 500 or reason is ErrorReason.DEADLINE_EXCEEDED
    if 400 <= spec.http_status < 500 and spec.http_status != 429:
        assert spec.retry_scope is RetryScope.NEVER


def test_an_error_survives_pickling_with_every_field() -> None:
    error = PdserveError(
        ErrorReason.CACHE_SYNC_FAILED,
        "broken stream",
        {"leaseId": "lease-7"},
        retry_delay_s=0.5,
        code=grpc.StatusCode.ABORTED,
    )
    copy = pickle.loads(pickle.dumps(error))
    assert copy == error
    assert (copy.code, copy.retry_delay_s, copy.metadata) == (
        grpc.StatusCode.ABORTED,
        0.5,
        {"leaseId": "lease-7"},
    )
