"""Protocol version negotiation and the KV layout fingerprint.

Peers accept the same MAJOR with any MINOR (rolling upgrades between N and N-1) and refuse a
different MAJOR with ``INCOMPATIBLE_PEER``. A minor bump adds fields, RPCs or features; a major
bump is a new proto package (``pdserve.v2``).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from pdserve.common.errors import ErrorReason, PdserveError

# NOTE: bump MINOR with every contract addition; refresh the buf baseline (make
# contract-baseline) only together with such a bump.
PROTOCOL_VERSION = "1.18"

# Capabilities this implementation speaks (see Protocol.features in common.proto).
FEATURES: tuple[str, ...] = (
    "preemption-notice",
    "token-index",
    "sync-cache-grpc",
    "constraints",
    "token-filters",
)

_VERSION_RE = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)$")


@dataclass(frozen=True, order=True)
class ProtocolVersion:
    """A parsed "MAJOR.MINOR" contract version."""

    major: int
    minor: int

    @classmethod
    def parse(cls, text: str) -> ProtocolVersion:
        """Parses "MAJOR.MINOR"; raises INCOMPATIBLE_PEER for anything else (empty included)."""
        match = _VERSION_RE.match(text)
        if match is None:
            raise PdserveError(
                ErrorReason.INCOMPATIBLE_PEER,
                f"malformed protocol version {text!r}, expected MAJOR.MINOR",
                {"peerVersion": text},
            )
        return cls(int(match.group(1)), int(match.group(2)))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


LOCAL_VERSION = ProtocolVersion.parse(PROTOCOL_VERSION)


def check_compatible(
    peer_version: str, local_version: ProtocolVersion = LOCAL_VERSION
) -> ProtocolVersion:
    """Accepts a peer with the same major version, any minor.

    Args:
        peer_version: The version string the peer sent.
        local_version: Our version (parameterised for tests).

    Returns:
        The peer's parsed version.

    Raises:
        PdserveError: INCOMPATIBLE_PEER when the version is malformed or the majors differ.
    """
    peer = ProtocolVersion.parse(peer_version)
    if peer.major != local_version.major:
        raise PdserveError(
            ErrorReason.INCOMPATIBLE_PEER,
            f"peer speaks protocol {peer}, this instance speaks {local_version}",
            {"peerVersion": str(peer), "localVersion": str(local_version)},
        )
    return peer


def common_features(peer_features: list[str] | tuple[str, ...]) -> frozenset[str]:
    """Capabilities both sides list; unknown names are ignored."""
    return frozenset(FEATURES) & frozenset(peer_features)


def kv_layout_fingerprint(
    model_id: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_name: str,
    block_size: int,
) -> str:
    """The language-neutral KV layout fingerprint defined in common.proto (KvLayout).

    Args:
        model_id: Model identity (name plus weights digest).
        num_layers: Decoder layers.
        num_kv_heads: KV heads per layer.
        head_dim: Size of one head.
        dtype_name: The KvDtype value name, e.g. "KV_DTYPE_FLOAT32".
        block_size: Tokens per block.

    Returns:
        Lower-case hex SHA-256 of the canonical string.
    """
    canonical = (
        f"pdserve-kv-v1|{model_id}|{num_layers}|{num_kv_heads}|{head_dim}|{dtype_name}|{block_size}"
    )
    return hashlib.sha256(canonical.encode()).hexdigest()
