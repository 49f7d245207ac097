"""NIXL's own floor on one host: bare WRITEs between two processes, by destination memory.

    .venv/bin/python bench/nixl_floor.py                     # 64 MiB, 256 KiB descriptors
    .venv/bin/python bench/nixl_floor.py --descriptor-kib 64 256 2048 --json

No pdserve transfer around it: one process registers a destination buffer with a NIXL agent
(`pdserve.kv.transports.nixl.new_agent`, as a cache's agent), another
posts one WRITE transfer of the whole size from its own registered buffer, in descriptors of
the given size, and polls it to completion; the clock runs from the post to DONE. Between two
processes of one host UCX puts through CMA (``process_vm_writev``), which looks up every
destination page it writes, so the rate depends on how the destination is backed:

* ``anon-huge``: anonymous memory advised for transparent huge pages (``MADV_HUGEPAGE``; a
  2 MiB page is one lookup where 512 small ones were);
* ``anon``: anonymous memory on small pages (``MADV_NOHUGEPAGE``), as a torch CPU tensor is;
* ``shm``: a file in ``/dev/shm`` mapped shared, as a decode's cache is when it offers the
  shm transport (tmpfs pages are small unless the mount says ``huge=``).

`bench/kv_transfer.py` measures pdserve's nixl transfers, which write into the decode's cache
(in ``/dev/shm`` by default) and checksum at both ends; this is the copy they cannot beat on
the same host. Every run checks the bytes arrived. Results go to
bench/results/nixl_floor-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from common import write_results

from pdserve.kv.transports import nixl

MIB = 1 << 20
DESTINATIONS = ("anon-huge", "anon", "shm")
THP = Path("/sys/kernel/mm/transparent_hugepage")


def _destination(kind: str, nbytes: int) -> tuple[mmap.mmap, str | None]:
    if kind == "shm":
        path = f"/dev/shm/pdserve-nixl-floor-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            return mmap.mmap(fd, nbytes), path
        finally:
            os.close(fd)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE if kind == "anon-huge" else mmap.MADV_NOHUGEPAGE)
    return region, None


def _target(conn: Connection, kind: str, nbytes: int) -> None:
    """The destination process: registers its buffer, progresses its agent until told to
    stop, then answers with a digest of what arrived."""
    agent = nixl.new_agent(f"floor-target-{os.getpid()}")
    region, path = _destination(kind, nbytes)
    try:
        buffer = np.frombuffer(region, dtype=np.uint8)
        buffer[:: 1 << 12] = 1  # NOTE: every page present before the clock, as a cache's are
        agent.register_memory([(buffer.ctypes.data, nbytes, 0, "")], "DRAM")
        conn.send((agent.get_agent_metadata(), buffer.ctypes.data))
        while not conn.poll(0.0005):
            agent.get_new_notifs()  # NOTE: progresses UCX, as a decode's agent does
        conn.recv()
        conn.send(int(buffer[::4093].astype(np.uint64).sum()))
        del buffer
    finally:
        if path is not None:
            os.unlink(path)


def measure(kind: str, nbytes: int, descriptor_kibs: list[int], repeats: int) -> dict[str, Any]:
    """Median seconds and MiB/s of one WRITE of `nbytes` into a `kind` destination, per
    descriptor size."""
    here, there = mp.Pipe()
    process = mp.get_context("spawn").Process(target=_target, args=(there, kind, nbytes))
    process.start()
    try:
        metadata, remote_address = here.recv()
        agent = nixl.new_agent(f"floor-sender-{os.getpid()}")
        source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        agent.register_memory([(source.ctypes.data, nbytes, 0, "")], "DRAM")
        name = agent.add_remote_agent(metadata)
        rows = []
        for kib in descriptor_kibs:
            size = kib << 10
            offsets = np.arange(0, nbytes, size, dtype=np.uint64)
            lengths = np.full_like(offsets, size)
            zeros = np.zeros_like(offsets)
            local = np.ascontiguousarray(
                np.stack([source.ctypes.data + offsets, lengths, zeros], 1)
            )
            remote = np.ascontiguousarray(np.stack([remote_address + offsets, lengths, zeros], 1))
            seconds = []
            for _ in range(repeats):
                began = time.perf_counter()
                handle = agent.initialize_xfer(
                    "WRITE",
                    agent.get_xfer_descs(local, "DRAM"),
                    agent.get_xfer_descs(remote, "DRAM"),
                    name,
                )
                agent.transfer(handle)
                while (state := agent.check_xfer_state(handle)) == "PROC":
                    pass
                if state != "DONE":
                    raise RuntimeError(f"the WRITE ended {state}")
                agent.release_xfer_handle(handle)
                seconds.append(time.perf_counter() - began)
            median = statistics.median(seconds)
            rows.append(
                {
                    "descriptor_kib": kib,
                    "num_descriptors": len(offsets),
                    "seconds": median,
                    "mib_per_s": nbytes / MIB / median,
                }
            )
        here.send("stop")
        if here.recv() != int(source[::4093].astype(np.uint64).sum()):
            raise RuntimeError(f"the bytes written into {kind} memory did not all arrive")
        return {"destination": kind, "rows": rows}
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--descriptor-kib", type=int, nargs="+", default=[256])
    parser.add_argument("--destinations", nargs="+", choices=DESTINATIONS, default=DESTINATIONS)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    try:
        nixl.load_api()
    except nixl.NixlUnavailable as error:
        sys.exit(f"nixl_floor: {error} (install the nixl extra)")
    nbytes = args.size_mib * MIB
    results: dict[str, Any] = {
        "size_mib": args.size_mib,
        "repeats": args.repeats,
        "thp": {
            path.name: path.read_text().strip()
            for path in map(THP.joinpath, ("enabled", "shmem_enabled"))
            if path.exists()
        },
        "destinations": [],
    }
    for kind in args.destinations:
        measured = measure(kind, nbytes, args.descriptor_kib, args.repeats)
        results["destinations"].append(measured)
        for row in measured["rows"]:
            print(
                f"{args.size_mib} MiB into {kind:9s} in {row['num_descriptors']:5d} descriptors of "
                f"{row['descriptor_kib']:5d} KiB: {row['seconds'] * 1e3:6.2f} ms "
                f"{row['mib_per_s']:8.0f} MiB/s"
            )
    path = write_results("nixl_floor", results)
    if args.json:
        print(json.dumps(results))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
