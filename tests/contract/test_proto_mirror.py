"""The Python error enums, the contract table and the proto's own comments agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve.common.errors import REASON_SPECS, ErrorReason, RetryScope
from pdserve.v1 import errors_pb2

ERRORS_PROTO = Path(__file__).resolve().parents[2] / "protos/pdserve/v1/errors.proto"


def _proto_names(enum: object, prefix: str) -> set[str]:
    names = {v.name for v in enum.DESCRIPTOR.values}  # type: ignore[attr-defined]
    return {n.removeprefix(prefix) for n in names} - {"UNSPECIFIED"}


def test_python_reasons_mirror_the_proto() -> None:
    assert {r.name for r in ErrorReason} == _proto_names(errors_pb2.ErrorReason, "ERROR_REASON_")
    assert set(REASON_SPECS) == set(ErrorReason)


def test_python_scopes_mirror_the_proto() -> None:
    assert {s.name for s in RetryScope} == _proto_names(errors_pb2.RetryScope, "RETRY_SCOPE_")


def _value_comments() -> dict[str, str]:
    """Maps each ErrorReason value to the comment block above it in errors.proto."""
    comments: dict[str, str] = {}
    block: list[str] = []
    for line in ERRORS_PROTO.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("//"):
            block.append(stripped.removeprefix("//").strip())
            continue
        match = re.match(r"ERROR_REASON_(\w+) = \d+;", stripped)
        if match:
            comments[match.group(1)] = " ".join(block)
        block = []
    return comments


@pytest.mark.parametrize("reason", list(ErrorReason), ids=lambda r: r.name)
def test_proto_comment_states_code_and_scope(reason: ErrorReason) -> None:
    comment = _value_comments()[reason.name]
    spec = REASON_SPECS[reason]
    for code in spec.codes:
        assert code.name in comment, f"{reason.name}: comment does not name gRPC {code.name}"
    assert f"retry scope {spec.retry_scope.name}" in comment
