"""The NIXL KV transport's two ends: a KV cache registered with a NIXL agent, and the writer of
one lease's blocks into a decode's registered cache with one-sided WRITEs.

NIXL (the transfer library vLLM, SGLang and Dynamo move KV with; the optional ``nixl`` install
extra) registers memory once and moves it with one-sided READs and WRITEs through a backend;
its UCX backend picks shared memory or TCP between CPU hosts, CUDA IPC or NVLink between GPUs
of a host, and RDMA between hosts. Both ends register their whole KV cache once
(`CacheAgent`): DRAM for a cache on CPU, VRAM for one on CUDA, so the same code serves both
(the VRAM path has not run on a GPU yet).

The decode describes one lease as a `NixlTarget`: its agent's metadata and the address of each
leased block, nothing else. A prefill loads the metadata once per decode agent (`NixlPeers`)
and writes a lease's pieces through a `NixlWindow`, which, like the shared-memory
`pdserve.kv.shm.LeaseWindow`, addresses pieces by their logical blocks within the lease: a
write outside the leased blocks cannot be expressed. The decode still verifies every chunk's
CRC-32C in its own cache before it commits.
"""

from __future__ import annotations

import importlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import numpy as np
import structlog

from pdserve.engine.kv_cache import KVCache
from pdserve.kv.transfer import KvPiece, chunk_crc32c

log = structlog.get_logger(__name__)

# The backend every agent starts (shared memory, TCP, CUDA IPC, NVLink and RDMA through UCX).
BACKEND = "UCX"
# NOTE: the meta package `nixl` picks the wheel of the CUDA version in use; `nixl_cu12` is what
# the install extra pins (it also runs on a host without CUDA).
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
# Polling a WRITE under way: without a pause (only yielding) for its first milliseconds, in
# which a group of a few MiB completes, then with pauses doubling up to a millisecond.
_BUSY_POLL_S = 0.005
_MAX_POLL_S = 0.001
# Pause between two progress calls of a target agent while transfers into it are open.
_PROGRESS_PAUSE_S = 5e-5
# How long a posted WRITE may take before the window gives up on the decode (a partition or a
# hung peer: over TCP a WRITE then never completes) and drops its agent.
WRITE_TIMEOUT_S = 30.0


class NixlUnavailable(Exception):
    """NIXL cannot be used here (not installed, no UCX backend, an agent that cannot load a
    peer)."""


def load_api() -> ModuleType:
    """NIXL's Python API (``nixl_agent`` and friends).

    Raises:
        NixlUnavailable: No NIXL wheel is installed, or it cannot be imported here.
    """
    errors = []
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as error:
            errors.append(f"{name}: {error}")
    raise NixlUnavailable("nixl is not installed (" + "; ".join(errors) + ")")


def is_installed() -> bool:
    """Whether NIXL's Python API imports here."""
    try:
        load_api()
    except NixlUnavailable:
        return False
    return True


@dataclass(frozen=True)
class NixlTarget:
    """Where one lease's KV goes on the decode (the NixlTarget message without protobuf).

    Block ``i`` of the lease, layer ``l``, K (``kv`` 0) or V (1) starts at
    ``block_addresses[i] + l * layer_stride_bytes + kv * kv_stride_bytes``.
    """

    agent_metadata: bytes
    agent_name: str
    memory_kind: str
    device_id: int
    block_addresses: tuple[int, ...]
    layer_stride_bytes: int
    kv_stride_bytes: int
    block_nbytes: int

    def for_blocks(self, block_ids: Sequence[int]) -> NixlTarget:
        """This target narrowed to `block_ids` (indices of its blocks): a decode keeps the
        target of its whole cache and hands each lease the one of its blocks."""
        addresses = self.block_addresses
        return replace(self, block_addresses=tuple(addresses[b] for b in block_ids))

    def address(self, layer_index: int, kv_index: int, block: int) -> int:
        """Where logical block `block` of the lease starts in layer `layer_index`'s K or V."""
        return (
            self.block_addresses[block]
            + layer_index * self.layer_stride_bytes
            + kv_index * self.kv_stride_bytes
        )


class CacheAgent:
    """A NIXL agent with a whole KV cache registered (both ends own one).

    Args:
        kv_cache: The cache to register; it must not move afterwards (a decode registers it
            after placing it in its shared-memory segment).
        role: What the agent's name starts with ("decode", "prefill").

    Raises:
        NixlUnavailable: NIXL is not installed, or its UCX backend does not start.
    """

    def __init__(self, kv_cache: KVCache, role: str) -> None:
        api = load_api()
        self.name = f"pdserve-{role}-{os.getpid()}-{secrets.token_hex(8)}"
        # NOTE: several transfers post and poll from worker threads at once. No progress
        # thread: NIXL's polls an idle agent at about a fifth of a core; a sender progresses
        # its own WRITEs as it polls them, a target only while transfers are open (`Progress`).
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            backends=[BACKEND],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            self.agent: Any = api.nixl_agent(self.name, config)
        except Exception as error:  # NOTE: NIXL raises its own exception types
            raise NixlUnavailable(f"the NIXL agent does not start: {error}") from None
        if BACKEND not in self.agent.backends:
            raise NixlUnavailable(f"NIXL has no {BACKEND} backend here")
        if not kv_cache.kv.is_contiguous():
            raise NixlUnavailable("the KV cache is a strided view (one rank's heads)")
        self.kv_cache = kv_cache
        self.memory_kind = "VRAM" if kv_cache.device.type == "cuda" else "DRAM"
        self.device_id = kv_cache.device.index or 0
        layout = kv_cache.layout
        self.block_nbytes = layout.block_nbytes
        # kv: [num_layers, 2, num_blocks, block bytes...] (one contiguous tensor)
        self.base_address = kv_cache.kv.data_ptr()
        self.kv_stride_bytes = kv_cache.num_blocks * self.block_nbytes
        self.layer_stride_bytes = 2 * self.kv_stride_bytes
        self._registered = self.agent.register_memory(
            [(self.base_address, kv_cache.nbytes, self.device_id, "")], self.memory_kind
        )
        # NOTE: one registered byte, the source of a corrupting write (fault injection).
        self._scratch = np.zeros(1, dtype=np.uint8)
        self._scratch_registered = self.agent.register_memory(
            [(self._scratch.ctypes.data, 1, 0, "")], "DRAM"
        )
        self.metadata: bytes = self.agent.get_agent_metadata()
        self.progress = Progress(self.agent)
        log.info(
            "nixl_agent_started",
            agent=self.name,
            backend=BACKEND,
            memory_kind=self.memory_kind,
            num_bytes=kv_cache.nbytes,
        )

    def block_address(self, layer_index: int, kv_index: int, block_id: int) -> int:
        """Where physical block `block_id` of layer `layer_index`'s K or V starts."""
        return (
            self.base_address
            + layer_index * self.layer_stride_bytes
            + kv_index * self.kv_stride_bytes
            + block_id * self.block_nbytes
        )

    def target(self, block_ids: Sequence[int] | None = None) -> NixlTarget:
        """The NixlTarget of a lease holding `block_ids` of this (the decode's) cache; of every
        block when None."""
        if block_ids is None:
            block_ids = range(self.kv_cache.num_blocks)
        return NixlTarget(
            agent_metadata=self.metadata,
            agent_name=self.name,
            memory_kind=self.memory_kind,
            device_id=self.device_id,
            block_addresses=tuple(self.block_address(0, 0, b) for b in block_ids),
            layer_stride_bytes=self.layer_stride_bytes,
            kv_stride_bytes=self.kv_stride_bytes,
            block_nbytes=self.block_nbytes,
        )

    def close(self) -> None:
        """Deregisters the cache (no peer can reach it through this agent afterwards)."""
        self.agent.deregister_memory(self._registered)
        self.agent.deregister_memory(self._scratch_registered)


class Progress:
    """Drives a target agent's backend while transfers into it are open: over UCX the sender's
    WRITEs complete (and, over TCP, land) only as the target makes progress, and without a
    progress thread nothing else does it.

    Args:
        agent: The NIXL agent.
    """

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._num_open = 0
        self._lock = threading.Lock()
        self._is_open = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self) -> Callable[[], None]:
        """Keeps the agent progressing until the returned function is called (once)."""
        with self._lock:
            self._num_open += 1
            self._is_open.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nixl-progress", daemon=True)
                self._thread.start()
        is_released = False

        def release() -> None:
            nonlocal is_released
            with self._lock:
                if is_released:
                    return
                is_released = True
                self._num_open -= 1
                if not self._num_open:
                    self._is_open.clear()

        return release

    @property
    def num_open(self) -> int:
        """Transfers holding the agent progressing."""
        return self._num_open

    def _run(self) -> None:
        while True:
            self._is_open.wait()
            try:
                self._agent.get_new_notifs()  # NOTE: progresses the backend's workers
            except Exception as error:  # NOTE: NIXL raises its own exception types
                log.warning("nixl_progress_failed", detail=str(error))
            time.sleep(_PROGRESS_PAUSE_S)


def start_agent(kv_cache: KVCache, role: str) -> Future[CacheAgent]:
    """Starts a `CacheAgent` on a thread: the first agent of a process takes about half a
    second (UCX and NIXL's plugins load), which an instance's start need not wait for.

    The future's exception is always a `NixlUnavailable`.
    """
    future: Future[CacheAgent] = Future()

    def run() -> None:
        try:
            future.set_result(CacheAgent(kv_cache, role))
        except NixlUnavailable as error:
            future.set_exception(error)
        except Exception as error:  # NOTE: anything NIXL or UCX raise means "not here"
            future.set_exception(NixlUnavailable(f"{type(error).__name__}: {error}"))

    threading.Thread(target=run, name=f"nixl-{role}-start", daemon=True).start()
    return future


class NixlPeers:
    """The sender's agent and the decode agents it loaded, by name.

    Args:
        local: This prefill's agent, with its own cache registered (the WRITEs' source).
    """

    def __init__(self, local: CacheAgent) -> None:
        self.local = local
        self._loaded: set[str] = set()
        self._lock = threading.Lock()

    def window(self, target: NixlTarget, num_shared_blocks: int = 0) -> NixlWindow:
        """The writer of one lease's blocks (the first `num_shared_blocks` of them, which the
        lease shares with another, are never written).

        Raises:
            NixlUnavailable: The decode's agent metadata cannot be loaded here, or its block
                size is not this cache's.
        """
        if target.block_nbytes != self.local.block_nbytes:
            raise NixlUnavailable(
                f"blocks of {target.block_nbytes} bytes, this cache's are {self.local.block_nbytes}"
            )
        with self._lock:
            if target.agent_name not in self._loaded:
                try:
                    name = self.local.agent.add_remote_agent(target.agent_metadata)
                except Exception as error:  # NOTE: NIXL raises its own exception types
                    raise NixlUnavailable(f"agent {target.agent_name}: {error}") from None
                if _text(name) != target.agent_name:
                    self.local.agent.remove_remote_agent(name)
                    raise NixlUnavailable(
                        f"the metadata names agent {_text(name)}, not {target.agent_name}"
                    )
                self._loaded.add(target.agent_name)
        return NixlWindow(self, target, num_shared_blocks)

    def forget(self, agent_name: str) -> None:
        """Drops a decode agent (after a failed WRITE: its process may be gone); the next
        window to it loads it again."""
        with self._lock:
            if agent_name in self._loaded:
                self._loaded.discard(agent_name)
                try:
                    self.local.agent.remove_remote_agent(agent_name)
                except Exception as error:  # NOTE: NIXL raises its own exception types
                    log.info("nixl_remove_peer_failed", agent=agent_name, detail=str(error))


class NixlWindow:
    """Writes one lease's KV into its blocks of a decode's registered cache, and nowhere else.

    `write` takes one piece's blocks and returns its CRC-32C; `post` posts the WRITEs of every
    piece taken since as one transfer (runs contiguous on both sides merged into one
    descriptor); `wait` posts and returns once every posted WRITE completed: then they are in
    the decode's memory.

    Args:
        peers: The sender's agent and loaded decode agents.
        target: The lease's blocks on the decode.
        num_shared_blocks: Leading blocks the lease shares with another lease: never written.
        timeout_s: How long `wait` waits for posted WRITEs before it gives up.
    """

    def __init__(
        self,
        peers: NixlPeers,
        target: NixlTarget,
        num_shared_blocks: int = 0,
        timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        self.peers = peers
        self.timeout_s = timeout_s
        self.local = peers.local
        self.target = target
        self.num_shared_blocks = num_shared_blocks
        # (address, length, device) rows here and on the decode, of the WRITEs to post
        self._local: list[list[int]] = []
        self._remote: list[list[int]] = []
        # (decode address, byte) of the bytes to flip once the WRITEs landed (fault injection)
        self._flips: list[tuple[int, int]] = []
        self._posted: list[Any] = []

    def write(self, piece: KvPiece, *, corrupt: bool = False) -> int:
        """Takes the WRITEs of `piece` into the lease's blocks (from the sender's own cache,
        its ``source_block_ids``; `wait` posts them); returns the CRC-32C of the piece.

        `corrupt` flips one written byte after the checksum (fault injection).

        Raises:
            IndexError: The piece's logical blocks are not all within the lease's writable
                blocks.
            ValueError: The piece was not cut from the sender's cache.
        """
        end = piece.first_block + piece.num_blocks
        num_leased = len(self.target.block_addresses)
        if piece.first_block < 0 or end > num_leased or piece.num_blocks <= 0:
            raise IndexError(
                f"blocks {piece.first_block}..{end - 1} outside the lease's {num_leased}"
            )
        if piece.first_block < self.num_shared_blocks:
            raise IndexError(
                f"blocks {piece.first_block}..{end - 1} include the lease's "
                f"{self.num_shared_blocks} shared blocks"
            )
        if len(piece.source_block_ids) != piece.num_blocks:
            raise ValueError("a NIXL write reads the sender's cache: the piece has no blocks there")
        crc = chunk_crc32c(piece.key, piece.value)
        self._add_descriptors(piece)
        if corrupt:
            first = np.frombuffer(piece.key, dtype=np.uint8, count=1)[0]
            address = self.target.address(piece.layer_index, 0, piece.first_block)
            self._flips.append((address, int(first) ^ 0xFF))
        return crc

    def post(self) -> None:
        """Posts the WRITEs taken so far as one transfer, without waiting for it.

        Raises:
            NixlUnavailable: The transfer cannot be posted.
        """
        if not self._local:
            return
        local = np.array(self._local, dtype=np.uint64)
        remote = np.array(self._remote, dtype=np.uint64)
        self._local.clear()
        self._remote.clear()
        try:
            self._post(local, remote, self.local.memory_kind)
        except NixlUnavailable:
            self._abandon()
            raise

    def wait(self) -> None:
        """Posts the WRITEs taken so far and returns once every posted WRITE completed.

        Raises:
            NixlUnavailable: A WRITE failed (the decode's process or connection is gone), or
                did not complete within the window's timeout.
        """
        self.post()
        try:
            self._poll()
            for address, value in self._flips:
                # NOTE: after the piece's own WRITE landed, so that it is not overwritten.
                self.local._scratch[0] = value
                self._post(
                    np.array([[self.local._scratch.ctypes.data, 1, 0]], dtype=np.uint64),
                    np.array([[address, 1, self.target.device_id]], dtype=np.uint64),
                    "DRAM",
                )
                self._poll()
            self._flips.clear()
        except NixlUnavailable:
            self._abandon()
            raise

    def _add_descriptors(self, piece: KvPiece) -> None:
        """Adds the rows of the piece's K then V blocks, here and on the decode; a block that
        continues the last row on both sides extends it."""
        nbytes = self.target.block_nbytes
        local, remote = self._local, self._remote
        for kv_index in (0, 1):
            for offset, source_id in enumerate(piece.source_block_ids):
                src = self.local.block_address(piece.layer_index, kv_index, source_id)
                dst = self.target.address(piece.layer_index, kv_index, piece.first_block + offset)
                if (
                    local
                    and local[-1][0] + local[-1][1] == src
                    and (remote[-1][0] + remote[-1][1] == dst)
                ):
                    local[-1][1] += nbytes
                    remote[-1][1] += nbytes
                    continue
                local.append([src, nbytes, self.local.device_id])
                remote.append([dst, nbytes, self.target.device_id])

    def _post(self, local: np.ndarray, remote: np.ndarray, local_kind: str) -> None:
        agent = self.local.agent
        try:
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(local, local_kind),
                agent.get_xfer_descs(remote, self.target.memory_kind),
                self.target.agent_name,
            )
        except Exception as error:  # NOTE: NIXL raises its own exception types
            raise NixlUnavailable(f"a WRITE to {self.target.agent_name}: {error}") from None
        self._posted.append(handle)
        if agent.transfer(handle) == "ERR":
            raise NixlUnavailable(f"a WRITE to agent {self.target.agent_name} failed")

    def _poll(self) -> None:
        """Returns once every posted WRITE completed (polled, pausing up to a millisecond).

        Raises:
            NixlUnavailable: A WRITE failed, or is not done after `timeout_s`.
        """
        agent = self.local.agent
        pause = 0.0
        now = time.monotonic()
        busy_until = now + _BUSY_POLL_S
        deadline = now + self.timeout_s
        while self._posted:
            state = agent.check_xfer_state(self._posted[0])
            if state == "DONE":
                agent.release_xfer_handle(self._posted.pop(0))
                pause = 0.0
            elif state == "PROC":
                if time.monotonic() > deadline:
                    raise NixlUnavailable(
                        f"a WRITE to agent {self.target.agent_name} not done after "
                        f"{self.timeout_s:.0f} s"
                    )
                time.sleep(pause)
                if time.monotonic() > busy_until:
                    pause = min(_MAX_POLL_S, 2 * pause or 1e-5)
            else:
                raise NixlUnavailable(f"a WRITE to agent {self.target.agent_name} failed")

    def _abandon(self) -> None:
        """After a failed WRITE: releases what is posted and drops the decode's agent."""
        for handle in self._posted:
            try:
                self.local.agent.release_xfer_handle(handle)
            except Exception as error:  # NOTE: a handle still under way cannot be released
                log.info("nixl_release_failed", detail=str(error))
        self._posted.clear()
        self._local.clear()
        self._remote.clear()
        self._flips.clear()
        self.peers.forget(self.target.agent_name)


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name
