"""Handing memory that glibc's allocator keeps after a burst of work back to the system, and
bounding what oneDNN keeps for GEMM shapes it may never see again."""

from __future__ import annotations

import ctypes
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
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return
    libc.malloc_trim(0)
