"""Handing memory that glibc's allocator keeps after a burst of work back to the system."""

from __future__ import annotations

import ctypes


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
