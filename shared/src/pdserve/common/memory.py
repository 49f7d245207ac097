"""Handing memory back to the system (what glibc's allocator keeps after a burst of work, the
pages of a shared mapping nobody needs), and bounding what oneDNN keeps for GEMM shapes it may
never see again."""

from __future__ import annotations

import ctypes
import mmap
import os

ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def bound_onednn_cache(capacity: int) -> int:
    """Caps oneDNN's cache of compiled primitives (one per GEMM shape; 1,024 by default) at
    `capacity`, unless the environment already sets ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``;
    returns the capacity in effect.

    oneDNN reads the variable when it builds its first primitive: call this before the
    process's first CPU GEMM (a fork server that ran none leaves it to each service).

    NOTE: a primitive holds about 0.3 MB (bf16 linear, AMD EPYC); a prefill's GEMM shapes follow
    its prompts' lengths, so the default cache grew a prefill's memory by about 350 MB over a
    few thousand requests of varied lengths while rarely being hit again.
    """
    value = os.environ.setdefault(ONEDNN_CACHE_ENV, str(capacity))
    return int(value) if value.isdigit() else capacity


def return_freed_memory() -> None:
    """Hands the free pages of glibc's heap and of its per-thread arenas back to the system
    (``malloc_trim(0)``); nothing where the C library is not glibc.

    NOTE: glibc keeps what a burst of work freed for later allocations, in the arena of the
    thread that did it: loading a model (the float copies before packing, the unpacked int4
    values: 120 MB of a bf16 engine's RSS on the default model) or building a tokenizer (its
    parsed tokenizer.json: 25 MB of the 42 a tokenizer of the default model takes to build).
    """
    malloc_trim = getattr(_LIBC, "malloc_trim", None)
    if malloc_trim is not None:  # glibc's
        malloc_trim(0)


# NOTE: the C library this process runs on (its own symbols): glibc's malloc_trim, madvise.
_LIBC = ctypes.CDLL(None, use_errno=True)
_MADV_REMOVE = getattr(mmap, "MADV_REMOVE", 9)


def remove_pages(begin: int, end: int) -> int:
    """Hands the whole pages within addresses ``[begin, end)`` of a shared mapping back to the
    system (``madvise(MADV_REMOVE)``: they read as zeros after, and take memory again once
    written).

    Returns:
        The bytes handed back, or -1 where the memory is no shared mapping.
    """
    page = mmap.PAGESIZE
    first, last = -(-begin // page) * page, end // page * page
    if last <= first:
        return 0
    if _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_REMOVE) != 0:
        return -1
    return last - first
