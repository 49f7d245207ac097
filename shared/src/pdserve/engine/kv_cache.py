"""The paged KV cache tensor and the export/import of its blocks as bytes."""

from __future__ import annotations

import math
import mmap
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from pdserve.common.generation import num_blocks_for
from pdserve.common.memory import remove_pages
from pdserve.engine.window_slots import WindowSlots

_BytesLike = bytes | bytearray | memoryview


@dataclass(frozen=True)
class KVCacheLayout:
    """Everything two processes must agree on to exchange KV blocks.

    Attributes:
        num_layers: Decoder layers.
        num_kv_heads: KV heads per layer.
        head_dim: Size of one head.
        block_size: Tokens per block.
        dtype: Cache dtype name (``float32``, ``bfloat16``, ``float16``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def block_nbytes(self) -> int:
        """Bytes of K (or of V) of one block in one layer."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @property
    def total_block_nbytes(self) -> int:
        """Bytes of one block of the cache: K and V in every layer."""
        return 2 * self.num_layers * self.block_nbytes

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape of a cache of `num_blocks` blocks:
        ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class KVBlockData(NamedTuple):
    """K and V bytes of a run of blocks in one layer (see ``KVCache.export_blocks``)."""

    k: memoryview
    v: memoryview


def num_blocks_for_budget(layout: KVCacheLayout, memory_bytes: int) -> int:
    """How many blocks fit in ``memory_bytes`` (all layers, K and V)."""
    return memory_bytes // layout.total_block_nbytes


def logical_blocks_touched(num_computed_tokens: int, num_new_tokens: int, block_size: int) -> range:
    """Indexes into a block table of the blocks that a chunk of new tokens writes to."""
    return range(
        num_computed_tokens // block_size,
        num_blocks_for(num_computed_tokens + num_new_tokens, block_size),
    )


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    # NOTE: numpy has no bfloat16, so expose the raw bytes through a uint8 view.
    return tensor.view(torch.uint8).numpy().data.cast("B")


def _zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in an anonymous mapping: its pages read as zeros and take memory only
    once written, so a large cache costs neither time nor memory until its blocks are used."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapping = mmap.mmap(-1, nbytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        # NOTE: the tensor holds a reference to the mapping; it is unmapped with the tensor.
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    return flat.view(dtype).view(shape)


def id_runs(block_ids: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Maximal runs of consecutive ids in `block_ids`, as ``(first_id, last_id + 1)``."""
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            yield block_ids[start], block_ids[i - 1] + 1
            start = i


def _contiguous_run(block_ids: Sequence[int]) -> bool:
    first = block_ids[0]
    return all(b == first + i for i, b in enumerate(block_ids))


def layer_storage(num_layers: int, window_layers: Sequence[int]) -> list[tuple[bool, int]]:
    """Where each layer's K/V live in a cache whose `window_layers` keep theirs in window
    slots: ``(in the window storage, the layer's index there)``, the other layers in order in
    the blocks' storage."""
    full_layers = [i for i in range(num_layers) if i not in window_layers]
    where = {layer: (False, index) for index, layer in enumerate(full_layers)}
    where |= {layer: (True, index) for index, layer in enumerate(window_layers)}
    return [where[layer] for layer in range(num_layers)]


class KVCache:
    """``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 is K, 1 is V).

    With ``window_layers`` (sliding-window layers that keep only their window,
    `pdserve.engine.window_slots`), ``kv`` holds the other layers only and the window layers'
    K/V live in ``window_kv``, ``[len(window_layers), 2, num_window_slots, block_size, ...]``,
    addressed through ``window_slots``. Placed in a shared segment (`place_in`), the window
    storage follows the blocks'; a writer in another process addresses a window layer's block
    by its slot (a decode's lease names them).

    Args:
        layout: Shape and dtype of the blocks.
        num_blocks: Blocks per layer.
        device: Where the cache lives.
        kv: The storage to use, of the cache's shape (e.g. a shared mapping, or a view of one
            rank's heads in it); a new zero tensor when None.
        window_layers: Layers whose K/V live in window slots.
        num_window_slots: How many slots they have (with ``window_layers``).
        window_kv: With `kv`, the window slots' storage to use (of ``window_kv``'s shape).
        window_slots: The slots' map to use (a view of another cache's heads shares its map);
            a new one when None.

    Attributes:
        shared_path: The shared-memory file that backs the cache when other processes map it
            too (the ranks of a tensor-parallel instance); None otherwise.
        window_slots: The block ids' slots in ``window_kv``; None without window layers.
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        num_blocks: int,
        device: torch.device,
        kv: torch.Tensor | None = None,
        window_layers: Sequence[int] = (),
        num_window_slots: int = 0,
        window_kv: torch.Tensor | None = None,
        window_slots: WindowSlots | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = layout.block_size
        self.device = device
        self.dtype: torch.dtype = getattr(torch, layout.dtype)
        window_layers = tuple(sorted(set(window_layers)))
        if window_layers and (kv is None) != (window_kv is None):
            raise ValueError("a cache with window layers takes both storages or neither")
        if any(not 0 <= i < layout.num_layers for i in window_layers):
            raise ValueError(f"window layers {window_layers} outside {layout.num_layers} layers")
        self._storage = layer_storage(layout.num_layers, window_layers)
        self.window_slots: WindowSlots | None = None
        shape = layout.cache_shape(num_blocks)
        if window_layers:
            self.window_slots = window_slots or WindowSlots(num_window_slots, num_blocks, device)
            shape = (layout.num_layers - len(window_layers), *shape[1:])
            window_shape = (len(window_layers), *layout.cache_shape(num_window_slots)[1:])
            if window_kv is not None and tuple(window_kv.shape) != window_shape:
                raise ValueError(
                    f"window storage of shape {tuple(window_kv.shape)}, not {window_shape}"
                )
            # window_kv: [len(window_layers), 2, num_window_slots, block_size, heads, head_dim]
            self.window_kv = (
                window_kv if window_kv is not None else self._zeros(window_shape, device)
            )
        self.window_layers = window_layers
        self.shared_path: Path | None = None
        if kv is not None and tuple(kv.shape) != shape:
            raise ValueError(f"storage of shape {tuple(kv.shape)} for a cache of shape {shape}")
        # kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv = kv if kv is not None else self._zeros(shape, device)
        self._can_release = True  # until madvise refuses the storage

    def _zeros(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if device.type == "cpu" and math.prod(shape) > 0:
            return _zeros_on_demand(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=device)

    def is_window_layer(self, layer_index: int) -> bool:
        """Whether the layer's K/V live in window slots (read through
        ``window_slots.slot_table``)."""
        return self._storage[layer_index][0]

    def place_in(self, buffer: memoryview, *, keep_contents: bool = True) -> None:
        """Moves the cache into `buffer` (e.g. a shared-memory mapping of at least `nbytes`
        bytes, on CPU), keeping its contents; the old tensor is dropped. A cache with window
        slots puts their storage (``window_kv``) right after the blocks'.

        `keep_contents=False` for a cache whose blocks hold nothing yet (none was ever handed
        out) and a buffer that reads as zeros (a new file's pages): nothing is copied, so the
        buffer's pages are touched only as blocks are written. Copying the empty cache wrote
        every page of it (377 MB for SmolLM2's 16,384 tokens) as the instance started.

        Raises:
            ValueError: If the cache is not on CPU, is shared with other processes, or `buffer`
                is too small.
        """
        if self.shared_path is not None:
            raise ValueError("a cache shared with other processes cannot move")
        if self.kv.device.type != "cpu":
            raise ValueError("only a CPU cache can be placed in a host buffer")
        if len(buffer) < self.nbytes:
            raise ValueError(f"buffer holds {len(buffer)} bytes, the cache needs {self.nbytes}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            placed = torch.frombuffer(buffer, dtype=torch.uint8, count=self.nbytes)
        placed = placed.view(self.dtype)
        # NOTE: the window slots' storage (if any) follows the blocks' in the buffer.
        num_kv = self.kv.numel()
        kv = placed[:num_kv].view(self.kv.shape)
        if keep_contents:
            kv.copy_(self.kv)
        self.kv = kv
        if self.window_slots is not None:
            window_kv = placed[num_kv:].view(self.window_kv.shape)
            if keep_contents:
                window_kv.copy_(self.window_kv)
            self.window_kv = window_kv

    def release_pages(self, block_ids: Sequence[int]) -> int:
        """Hands the memory of `block_ids` back to the system: the whole pages their K and V
        cover in every layer read as zeros after and take memory again once written. For
        blocks nobody reads or writes (free, keeping no prefix); a window layer's slots keep
        theirs.

        Only a CPU cache in one contiguous shared mapping does this (a prefill's own pool, which
        takes memory as its blocks are first written); elsewhere (a GPU, one rank's heads of a
        shared segment, private memory) it hands back nothing.

        Returns:
            The bytes handed back.
        """
        kv = self.kv
        if not block_ids or not self._can_release or kv.device.type != "cpu":
            return 0
        if not kv.is_contiguous():
            self._can_release = False
            return 0
        block_nbytes = self.layout.block_nbytes
        row_nbytes = self.num_blocks * block_nbytes  # one layer's K (or V)
        base = kv.data_ptr()
        released = 0
        for start, stop in id_runs(sorted(block_ids)):
            for row in range(kv.shape[0] * 2):
                begin = base + row * row_nbytes + start * block_nbytes
                removed = remove_pages(begin, begin + (stop - start) * block_nbytes)
                if removed < 0:
                    self._can_release = False
                    return released
                released += removed
        return released

    def block_bytes(self, layer_cache: torch.Tensor, start: int, stop: int) -> memoryview:
        """The bytes of blocks [start, stop) of one layer's K or V (a `layer` view) on CPU, as
        a view of the cache (no copy)."""
        return _as_bytes(layer_cache[start:stop])

    @property
    def nbytes(self) -> int:
        """Total bytes of the cache tensor (and of the window slots' storage)."""
        window = 0 if self.window_slots is None else self.window_kv.numel()
        return (self.kv.numel() + window) * self.kv.element_size()

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's K and V.

        Returns:
            ``(k, v)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]`` (a window
            layer's: ``[num_window_slots, ...]``, indexed by slot).
        """
        is_window, index = self._storage[layer_index]
        storage = self.window_kv if is_window else self.kv
        return storage[index, 0], storage[index, 1]

    def physical_blocks(self, layer_index: int, block_ids: Sequence[int]) -> list[int]:
        """Where `block_ids` live in the layer's storage: the ids, or a window layer's slots."""
        if self.window_slots is None or not self.is_window_layer(layer_index):
            return list(block_ids)
        return [self.window_slots.slot_of(b) for b in block_ids]

    def export_blocks(self, layer_index: int, block_ids: Sequence[int]) -> KVBlockData:
        """The K and V bytes of the given blocks of one layer, in the order given.

        Layout of each of ``k`` and ``v``: the blocks one after another; per block
        ``[block_size, num_kv_heads, head_dim]`` contiguous in the cache dtype (row-major, native
        byte order), i.e. ``len(block_ids) * layout.block_nbytes`` bytes.

        When ``block_ids`` is an ascending run of consecutive ids on CPU the views alias the cache
        itself (no copy): send them before those blocks are freed or rewritten. Otherwise the
        blocks are gathered once into a new contiguous buffer (and copied to host memory on GPU).

        Args:
            layer_index: Which decoder layer.
            block_ids: Physical block ids, e.g. a run of a sequence's block table.

        Returns:
            ``KVBlockData(k, v)`` as byte ``memoryview``s.
        """
        if not block_ids:
            raise ValueError("export_blocks needs at least one block id")
        block_ids = self.physical_blocks(layer_index, block_ids)
        k_cache, v_cache = self.layer(layer_index)
        if _contiguous_run(block_ids):
            first = block_ids[0]
            # k, v: [num_ids, block_size, num_kv_heads, head_dim] views of the cache
            k = k_cache[first : first + len(block_ids)]
            v = v_cache[first : first + len(block_ids)]
        else:
            index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            k, v = k_cache.index_select(0, index), v_cache.index_select(0, index)
        if k.device.type != "cpu":
            k, v = k.cpu(), v.cpu()
        return KVBlockData(_as_bytes(k), _as_bytes(v))

    def import_blocks(
        self, layer_index: int, block_ids: Sequence[int], k: _BytesLike, v: _BytesLike
    ) -> None:
        """Writes K and V bytes (the layout of ``export_blocks``) into the given blocks of a layer.

        Raises:
            ValueError: If the byte counts do not match ``len(block_ids)`` blocks.
        """
        if not block_ids:
            raise ValueError("import_blocks needs at least one block id")
        expected = len(block_ids) * self.layout.block_nbytes
        if len(k) != expected or len(v) != expected:
            raise ValueError(
                f"expected {expected} bytes each for K and V of {len(block_ids)} blocks, "
                f"got {len(k)} and {len(v)}"
            )
        block_ids = self.physical_blocks(layer_index, block_ids)
        k_cache, v_cache = self.layer(layer_index)
        shape = (len(block_ids), *k_cache.shape[1:])
        k_src = self._from_bytes(k).view(shape)
        v_src = self._from_bytes(v).view(shape)
        if _contiguous_run(block_ids):
            first = block_ids[0]
            k_cache[first : first + len(block_ids)].copy_(k_src)
            v_cache[first : first + len(block_ids)].copy_(v_src)
        else:
            index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            k_cache.index_copy_(0, index, k_src.to(self.device))
            v_cache.index_copy_(0, index, v_src.to(self.device))

    def _from_bytes(self, data: _BytesLike) -> torch.Tensor:
        with warnings.catch_warnings():
            # NOTE: the source is only read; torch warns about read-only buffers regardless.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype)
