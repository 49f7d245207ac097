"""The shared registry in etcd: where instances are written and how gateways find them.

``--registry etcd://HOST:PORT[/NAMESPACE]`` names an etcd (v3 API, 3.4 or newer) that
instances register in and every gateway watches, so several gateways share one view. Each
instance owns one key::

    [/NAMESPACE]/pdserve/v1/instances/<role>/<instance_id>

whose value is a serialized ``pdserve.v1.RegisterRequest`` (its InstanceInfo and its latest
LoadReport: the same message RegistryService receives, so the contract stays the one
description of an instance). The key is attached to an etcd lease that the instance keeps
alive; a lease that lapses deletes the key, which is how a dead instance leaves every gateway.

The client is ``aetcd`` (asyncio, etcd v3 gRPC API); connections are plaintext (``etcd://``):
the etcd itself must be on a trusted network, since whoever can write under the prefix can
announce instances.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import aetcd

SCHEME = "etcd"
INSTANCES_PREFIX = "/pdserve/v1/instances/"
RPC_TIMEOUT_S = 5.0
# NOTE: how an etcd client's channel connects. A network partition stalls a TCP connection
# (nothing is refused); TCP then sends again at doubling intervals, so once the link is back the
# connection may stay silent for seconds, or tens of seconds after a second cut. Each client
# therefore has connections of its own (gRPC shares one between every channel to the same
# address by default, so a client made anew to get a new connection got the stalled one
# again), and a client that found etcd unreachable is replaced (`pdserve.gateway.session.
# etcd_store`, the watcher, the registration). A connection attempt is given up after 2 s and
# the next one starts within 1 s (gRPC's defaults: 20 s and up to 120 s: an attempt made while
# etcd was cut off, its handshake lost, held every call for up to 20 s after the link was back).
CHANNEL_OPTIONS = {
    "grpc.use_local_subchannel_pool": 1,
    "grpc.min_reconnect_backoff_ms": 2000,  # also the shortest time a connection attempt gets
    "grpc.initial_reconnect_backoff_ms": 500,
    "grpc.max_reconnect_backoff_ms": 1000,
}
REGISTRY_HELP = (
    "shared registry: etcd://HOST:PORT[/NAMESPACE] (etcd v3 API); instances register there "
    "under an etcd lease and every gateway watches it, so several gateways see the same "
    "instances; unset: the registry embedded in one gateway (RegistryService)"
)


@dataclass(frozen=True)
class EtcdTarget:
    """Where the shared registry lives.

    Attributes:
        host: etcd client host.
        port: etcd client port.
        namespace: Key prefix in front of `INSTANCES_PREFIX` ("" for none), e.g. ``/prod``.
    """

    host: str
    port: int
    namespace: str = ""

    @classmethod
    def parse(cls, spec: str) -> EtcdTarget:
        """``etcd://HOST:PORT[/NAMESPACE]`` -> `EtcdTarget`.

        Raises:
            ValueError: Another scheme, or no host or port.
        """
        parts = urlsplit(spec)
        if parts.scheme != SCHEME:
            raise ValueError(
                f"registry must be etcd://HOST:PORT[/NAMESPACE] (plaintext etcd v3), got {spec!r}"
            )
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or parts.query or parts.fragment:
            raise ValueError(f"registry must be etcd://HOST:PORT[/NAMESPACE], got {spec!r}")
        return cls(parts.hostname, port, parts.path.rstrip("/"))

    @property
    def prefix(self) -> str:
        """The key prefix every instance key starts with."""
        return self.namespace + INSTANCES_PREFIX

    def instance_key(self, role: str, instance_id: str) -> bytes:
        """The key of one instance (`role` is ``prefill`` or ``decode``)."""
        return f"{self.prefix}{role}/{instance_id}".encode()

    def describe(self) -> str:
        """``etcd://host:port/namespace`` for logs."""
        return f"{SCHEME}://{self.host}:{self.port}{self.namespace}"

    def client(self) -> aetcd.Client:
        """A new, unconnected client (it connects on first use; see `CHANNEL_OPTIONS`)."""
        return aetcd.Client(
            host=self.host, port=self.port, timeout=RPC_TIMEOUT_S, options=CHANNEL_OPTIONS
        )


def check_registry_spec(spec: str | None) -> None:
    """Validates a ``--registry`` value (None: the embedded registry).

    Raises:
        ValueError: See `EtcdTarget.parse`.
    """
    if spec is not None:
        EtcdTarget.parse(spec)
