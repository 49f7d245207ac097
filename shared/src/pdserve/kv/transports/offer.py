"""What a decode offers a prefill to send KV over, besides gRPC SyncCache (which every decode
accepts): the `Transport` message of the contract without its token, as both ends hold it.
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.kv.transports.cuda_ipc import CacheHandle
from pdserve.kv.transports.nixl import NixlTarget


class TransportOffer(NamedTuple):
    """A way a decode accepts KV besides gRPC SyncCache: ``kind`` "shm" (address: the
    segment name), "tcp" (address: host:port), "cuda_ipc" (no address; ``handle``: the
    exported cache) or "nixl" (no address; ``nixl``: the decode's agent and blocks: in a
    decode's own offer every block of its cache, in a lease only the leased ones)."""

    kind: str
    address: str
    handle: CacheHandle | None = None
    nixl: NixlTarget | None = None
