"""The NIXL KV transport's agents: a KV cache registered with a NIXL agent (both ends), the
decode's description of a lease's blocks, and the decode agents a sender loaded.

NIXL (the transfer library vLLM, SGLang and Dynamo move KV with; the optional ``nixl`` install
extra) registers memory once and moves it with one-sided READs and WRITEs through a backend;
its UCX backend picks shared memory or TCP between CPU hosts, CUDA IPC or NVLink between GPUs
of a host, and RDMA between hosts. Both ends register their whole KV cache once
(`CacheAgent`): DRAM for a cache on CPU, VRAM for one on CUDA, so the same code serves both
(the VRAM path has not run on a GPU yet).

The decode describes one lease as a `NixlTarget`: its agent's metadata and the address of each
leased block, nothing else. A prefill loads the metadata once per decode agent (`NixlPeers`)
and writes a lease's pieces through a `pdserve.kv.transports.nixl_window.NixlWindow`.
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

log = structlog.get_logger(__name__)

# The backend every agent starts (shared memory, TCP, CUDA IPC, NVLink and RDMA through UCX).
BACKEND = "UCX"
# NOTE: the meta package `nixl` picks the wheel of the CUDA version in use; `nixl_cu12` is what
# the install extra pins (it also runs on a host without CUDA).
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
# Pause between two progress calls of a target agent while transfers into it are open. Between
# two processes of one host the WRITEs (CMA) need the target only to connect; over UCX's TCP
# each call takes in what arrived. 0.5 ms against 50 us: a 64 MiB transfer on one host took
# about a quarter less CPU (the polls also took the decode's GIL 20,000 times a second), and
# between two network namespaces over TCP nixl kept its ratio to raw TCP (docs/BENCHMARKS.md).
PROGRESS_PAUSE_S = 5e-4
# NOTE: UCX's memory events (hooks on mmap, munmap and friends, patched into every library the
# process loaded) keep its cache of implicit registrations right. Both ends here register their
# whole cache explicitly and send nothing else, so they are off unless the environment says
# otherwise: with torch's libraries loaded, installing the hooks was 0.40 of the UCX backend's
# 0.42 s start, all of it CPU (Dynamo's ModelExpress sets the same default for the same reason).
UCX_DEFAULTS = {"UCX_MEM_EVENTS": "no"}


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


def new_agent(name: str) -> Any:
    """A NIXL agent named `name` with the UCX backend, as every pdserve agent is configured.

    Raises:
        NixlUnavailable: NIXL is not installed, or its UCX backend does not start.
    """
    api = load_api()
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)  # NOTE: read when UCX's context is created
    # NOTE: several transfers post and poll from worker threads at once. No progress thread:
    # NIXL's polls an idle agent at about a fifth of a core; a sender progresses its own WRITEs
    # as it polls them, a target only while transfers are open (`Progress`).
    config = api.nixl_agent_config(
        enable_prog_thread=False,
        backends=[BACKEND],
        sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    try:
        agent = api.nixl_agent(name, config)
    except Exception as error:  # NOTE: NIXL raises its own exception types
        raise NixlUnavailable(f"the NIXL agent does not start: {error}") from None
    if BACKEND not in agent.backends:
        raise NixlUnavailable(f"NIXL has no {BACKEND} backend here")
    return agent


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
    ``block_addresses[i] + l * layer_stride_bytes + kv * kv_stride_bytes``. A decode whose
    sliding-window layers keep only their window (``window_layers``) addresses the other layers
    so (``l`` counting those only) and window layer ``w`` (its index in ``window_layers``) of
    block ``i`` at ``window_block_addresses[i - skipped] + w * window_layer_stride_bytes + kv *
    window_kv_stride_bytes``, where ``skipped`` leading blocks have no window storage.
    """

    agent_metadata: bytes
    agent_name: str
    memory_kind: str
    device_id: int
    block_addresses: tuple[int, ...]
    layer_stride_bytes: int
    kv_stride_bytes: int
    block_nbytes: int
    window_layers: tuple[int, ...] = ()
    window_block_addresses: tuple[int, ...] = ()
    window_layer_stride_bytes: int = 0
    window_kv_stride_bytes: int = 0

    @property
    def num_window_skipped(self) -> int:
        """Leading blocks of the lease without window storage (for the window layers)."""
        if not self.window_layers:
            return 0
        return len(self.block_addresses) - len(self.window_block_addresses)

    def for_blocks(self, block_ids: Sequence[int], slot_ids: Sequence[int] = ()) -> NixlTarget:
        """This target narrowed to `block_ids` (indices of its blocks) and, with window layers,
        to the window storage's `slot_ids` of the last of them: a decode keeps the target of
        its whole cache and hands each lease the one of its blocks."""
        addresses, slots = self.block_addresses, self.window_block_addresses
        return replace(
            self,
            block_addresses=tuple(addresses[b] for b in block_ids),
            window_block_addresses=tuple(slots[s] for s in slot_ids),
        )

    def address(self, layer_index: int, kv_index: int, block: int) -> int:
        """Where logical block `block` of the lease starts in layer `layer_index`'s K or V.

        Raises:
            IndexError: A window layer's block without window storage.
        """
        if self.window_layers:
            if layer_index in self.window_layers:
                skipped = self.num_window_skipped
                if block < skipped:
                    raise IndexError(f"block {block} of window layer {layer_index} has no slot")
                return (
                    self.window_block_addresses[block - skipped]
                    + self.window_layers.index(layer_index) * self.window_layer_stride_bytes
                    + kv_index * self.window_kv_stride_bytes
                )
            layer_index -= sum(1 for w in self.window_layers if w < layer_index)
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
        self.name = f"pdserve-{role}-{os.getpid()}-{secrets.token_hex(8)}"
        self.agent: Any = new_agent(self.name)
        if not kv_cache.kv.is_contiguous():
            raise NixlUnavailable("the KV cache is a strided view (one rank's heads)")
        self.kv_cache = kv_cache
        self.memory_kind = "VRAM" if kv_cache.device.type == "cuda" else "DRAM"
        self.device_id = kv_cache.device.index or 0
        layout = kv_cache.layout
        self.block_nbytes = layout.block_nbytes
        # kv: [num_layers, 2, num_blocks, block bytes...] (one contiguous tensor); with window
        # slots, the other layers only, and window_kv [window layers, 2, num_slots, ...]
        self.base_address = kv_cache.kv.data_ptr()
        self.kv_stride_bytes = kv_cache.num_blocks * self.block_nbytes
        self.layer_stride_bytes = 2 * self.kv_stride_bytes
        regions = [(self.base_address, kv_cache.kv.nbytes, self.device_id, "")]
        self.window_base_address = 0
        self.window_kv_stride_bytes = 0
        if kv_cache.window_slots is not None:
            self.window_base_address = kv_cache.window_kv.data_ptr()
            self.window_kv_stride_bytes = kv_cache.window_slots.num_slots * self.block_nbytes
            regions.append(
                (self.window_base_address, kv_cache.window_kv.nbytes, self.device_id, "")
            )
        # NOTE: where each layer's K and V start (a window layer's: its first slot's).
        self._layer_bases = [
            (k.data_ptr(), v.data_ptr()) for k, v in map(kv_cache.layer, range(layout.num_layers))
        ]
        self._registered = self.agent.register_memory(regions, self.memory_kind)
        # NOTE: one registered byte, the source of a corrupting write (fault injection).
        self.scratch = np.zeros(1, dtype=np.uint8)
        self._scratch_registered = self.agent.register_memory(
            [(self.scratch.ctypes.data, 1, 0, "")], "DRAM"
        )
        self._registrations = [self._registered, self._scratch_registered]
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
        """Where block `block_id` of layer `layer_index`'s K or V starts (a window layer's: its
        slot's).

        Raises:
            KeyError: A window layer's block without a slot.
        """
        if self.kv_cache.window_slots is not None and self.kv_cache.is_window_layer(layer_index):
            block_id = self.kv_cache.window_slots.slot_of(block_id)
        return self._layer_bases[layer_index][kv_index] + block_id * self.block_nbytes

    def target(
        self, block_ids: Sequence[int] | None = None, num_window_skipped: int = 0
    ) -> NixlTarget:
        """The NixlTarget of a lease holding `block_ids` of this (the decode's) cache (with
        window slots: the slots its blocks from `num_window_skipped` on hold); of every block
        (and every slot) when None."""
        cache, slots = self.kv_cache, self.kv_cache.window_slots
        if block_ids is None:
            block_ids = range(cache.num_blocks)
            slot_ids: Sequence[int] = range(0 if slots is None else slots.num_slots)
        else:
            held = block_ids[num_window_skipped:]
            slot_ids = [] if slots is None else [slots.slot_of(b) for b in held]
        return NixlTarget(
            agent_metadata=self.metadata,
            agent_name=self.name,
            memory_kind=self.memory_kind,
            device_id=self.device_id,
            block_addresses=tuple(self.base_address + b * self.block_nbytes for b in block_ids),
            layer_stride_bytes=self.layer_stride_bytes,
            kv_stride_bytes=self.kv_stride_bytes,
            block_nbytes=self.block_nbytes,
            window_layers=cache.window_layers if slots is not None else (),
            window_block_addresses=tuple(
                self.window_base_address + s * self.block_nbytes for s in slot_ids
            ),
            window_layer_stride_bytes=2 * self.window_kv_stride_bytes,
            window_kv_stride_bytes=self.window_kv_stride_bytes,
        )

    def close(self) -> None:
        """Deregisters the cache and the scratch byte from the agent (once; a failure is
        logged, not raised: the instance is stopping either way)."""
        registered, self._registrations = self._registrations, []
        for descriptors in registered:
            try:
                self.agent.deregister_memory(descriptors)
            except Exception as error:  # NOTE: NIXL raises its own error types
                log.warning("nixl_deregister_failed", agent=self.name, error=repr(error))


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
            time.sleep(PROGRESS_PAUSE_S)


# NOTE: how long a stopping instance waits for its agent to finish starting (about half a
# second; a process that exits while NIXL builds an agent on its thread aborts).
AGENT_START_WAIT_S = 30.0


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

    def load(self, target: NixlTarget) -> None:
        """Loads the agent of `target`'s decode, once per agent name (a window does it).

        Raises:
            NixlUnavailable: The decode's agent metadata cannot be loaded here, or its block
                size is not this cache's.
        """
        if target.block_nbytes != self.local.block_nbytes:
            raise NixlUnavailable(
                f"blocks of {target.block_nbytes} bytes, this cache's are {self.local.block_nbytes}"
            )
        with self._lock:
            if target.agent_name in self._loaded:
                return
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


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name
