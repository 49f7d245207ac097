"""``--kv-transports`` read the same way by a prefill and a decode: in order, each known
transport once; a bad list refused when the config is made."""

from __future__ import annotations

import pytest

from pdserve.decode.config import DecodeConfig
from pdserve.prefill.config import PrefillConfig
from pdserve.serving.config import transport_list

KNOWN = ("nixl", "shm", "tcp")


def test_the_list_keeps_its_order_and_drops_blanks() -> None:
    assert transport_list(" tcp, ,shm ", KNOWN, at_least_one=True) == ("tcp", "shm")
    assert transport_list("", KNOWN, at_least_one=False) == ()


@pytest.mark.parametrize(
    ("text", "at_least_one", "problem"),
    [
        ("shm,rdma", False, "unknown 'rdma'"),
        ("tcp,shm,tcp", False, "'tcp' twice"),
        (" , ", True, "none named"),
    ],
)
def test_a_bad_list_says_what_is_wrong(text: str, at_least_one: bool, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as raised:
        transport_list(text, KNOWN, at_least_one=at_least_one)
    assert "nixl, shm, tcp" in str(raised.value)


def test_each_role_refuses_a_bad_list_at_start() -> None:
    assert DecodeConfig(insecure=True, kv_transports="").kv_transport_kinds == ()
    with pytest.raises(ValueError, match="unknown 'grpc'"):
        DecodeConfig(insecure=True, kv_transports="shm,grpc")  # gRPC is always offered
    assert PrefillConfig(insecure=True, kv_transports="tcp,grpc").kv_transport_kinds == (
        "tcp",
        "grpc",
    )
    with pytest.raises(ValueError, match="none named"):
        PrefillConfig(insecure=True, kv_transports="")
    with pytest.raises(ValueError, match="'shm' twice"):
        PrefillConfig(insecure=True, kv_transports="shm,tcp,shm")
