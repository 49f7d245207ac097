from __future__ import annotations

import hashlib

import pytest

from pdserve.common.errors import ErrorReason, PdserveError
from pdserve.common.protocol import (
    FEATURES,
    PROTOCOL_VERSION,
    ProtocolVersion,
    check_compatible,
    common_features,
    kv_layout_fingerprint,
)


def test_local_version_is_major_one() -> None:
    assert ProtocolVersion.parse(PROTOCOL_VERSION).major == 1


@pytest.mark.parametrize(
    ("local", "peer"), [("1.0", "1.0"), ("1.0", "1.1"), ("1.3", "1.2"), ("1.3", "1.0")]
)
def test_same_major_accepted(local: str, peer: str) -> None:
    assert check_compatible(peer, ProtocolVersion.parse(local)) == ProtocolVersion.parse(peer)


@pytest.mark.parametrize("peer", ["2.0", "0.1", "3.4"])
def test_other_major_refused(peer: str) -> None:
    with pytest.raises(PdserveError) as caught:
        check_compatible(peer, ProtocolVersion(1, 0))
    assert caught.value.reason is ErrorReason.INCOMPATIBLE_PEER
    assert caught.value.metadata["peerVersion"] == peer


@pytest.mark.parametrize("peer", ["", "1", "1.0.0", "01.0", "a.b", " 1.0"])
def test_malformed_refused(peer: str) -> None:
    with pytest.raises(PdserveError) as caught:
        check_compatible(peer)
    assert caught.value.reason is ErrorReason.INCOMPATIBLE_PEER


def test_common_features_ignores_unknown_names() -> None:
    assert common_features([FEATURES[0], "teleport"]) == {FEATURES[0]}


def test_fingerprint_follows_the_documented_canonical_string() -> None:
    expected = hashlib.sha256(b"pdserve-kv-v1|demo@abc|4|2|32|KV_DTYPE_FLOAT32|16").hexdigest()
    assert kv_layout_fingerprint("demo@abc", 4, 2, 32, "KV_DTYPE_FLOAT32", 16) == expected


def test_fingerprint_changes_with_every_field() -> None:
    base = ("m", 4, 2, 32, "KV_DTYPE_FLOAT32", 16)
    variants = [
        ("n", 4, 2, 32, "KV_DTYPE_FLOAT32", 16),
        ("m", 5, 2, 32, "KV_DTYPE_FLOAT32", 16),
        ("m", 4, 1, 32, "KV_DTYPE_FLOAT32", 16),
        ("m", 4, 2, 64, "KV_DTYPE_FLOAT32", 16),
        ("m", 4, 2, 32, "KV_DTYPE_BFLOAT16", 16),
        ("m", 4, 2, 32, "KV_DTYPE_FLOAT32", 32),
    ]
    prints = {kv_layout_fingerprint(*v) for v in [base, *variants]}  # type: ignore[arg-type]
    assert len(prints) == len(variants) + 1
