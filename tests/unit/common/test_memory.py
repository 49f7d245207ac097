"""`return_freed_memory`: what a thread freed, kept by glibc in that thread's arena, goes back to
the system."""

from __future__ import annotations

import subprocess
import sys

# NOTE: in a process of its own, so that nothing else allocates meanwhile. A thread mallocs
# 80 MB in chunks of 4,000 bytes and frees all but one chunk in 64: the free pages between the
# survivors cannot shrink the arena's top, so glibc keeps them until trimmed.
PROBE = """
import ctypes, threading
from pdserve.common.memory import return_freed_memory

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def rss_anon_mb():
    with open("/proc/self/status") as status:
        line = next(l for l in status if l.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024

kept = []

def burst():
    chunks = [libc.malloc(4000) for _ in range(20_000)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, 4000)
    for index, chunk in enumerate(chunks):
        (kept.append if index % 64 == 0 else libc.free)(chunk)

thread = threading.Thread(target=burst)
thread.start()
thread.join()
before = rss_anon_mb()
return_freed_memory()
print(before, rss_anon_mb())
"""


def test_the_free_pages_of_a_threads_arena_go_back() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    before, after = (float(x) for x in result.stdout.split())
    assert before - after > 40, (before, after)
