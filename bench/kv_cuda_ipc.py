"""KV through the cuda_ipc transport's mapping: into another process's cache vs within one.

    python bench/kv_cuda_ipc.py --device cuda --dtype bfloat16 --sizes-mib 64 256 --json
    .venv/bin/python bench/kv_cuda_ipc.py --sizes-mib 4 --repeats 1   # CPU: the stand-in

A peer process (this script with ``--peer``) holds a KV cache and exports it as a decode does
(`pdserve.kv.transports.cuda_ipc.export_cache`: CUDA IPC on a GPU, the shared-memory stand-in on
CPU); this process maps it with the prefill's `MappedCaches` and writes one sequence's KV (that many
MiB of K+V, every layer) into every other block of it through a lease window (`CacheWindow`: layer
by layer, pieces of at most ``--max-chunk-bytes``, on a side stream on CUDA, waited for per layer),
from every other block of its own cache. The same window over a second cache in this process is the
baseline (``local``: a device-to-device copy in one process, same code), alternating with the mapped
one in each repeat. The checksums a transfer also pays are left out (every transport pays them).
After the runs the peer's digest of the leased blocks must equal this process's digest of the source
blocks (``bit_exact``).

Reported per size: MiB/s of both (median over repeats) and the ratio mapped / local. Results go
to bench/results/kv_cuda_ipc-<time>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import subprocess
import sys
import time
from typing import IO, Any

import torch
from common import write_results

from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transfer import KvPiece, blocks_per_piece
from pdserve.kv.transports.cuda_ipc import CacheHandle, export_cache
from pdserve.kv.transports.cuda_ipc_window import CacheWindow, MappedCaches

DEFAULT_SIZES_MIB = (64, 256)
EMPTY = memoryview(b"")


def layout_for(dtype: str) -> KVCacheLayout:
    """16 layers of 8 KV heads of 128, blocks of 16 tokens (1 MiB per block in bfloat16)."""
    return KVCacheLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype)


def digest(kv: torch.Tensor, block_ids: list[int]) -> str:
    """SHA-256 of blocks `block_ids` of every layer, K then V."""
    sha = hashlib.sha256()
    index = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
    for layer in range(kv.shape[0]):
        for kv_index in (0, 1):
            blocks = kv[layer, kv_index].index_select(0, index).cpu().contiguous()
            sha.update(blocks.view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def peer(device: str, dtype: str, num_blocks: int) -> None:
    """The exporting process: prints its handle, then answers ``digest IDS`` until ``quit``."""
    kv_cache = KVCache(layout_for(dtype), num_blocks, torch.device(device))
    export = export_cache(kv_cache)
    fields = dataclasses.asdict(export.handle)
    text = json.dumps({k: v.hex() if isinstance(v, bytes) else v for k, v in fields.items()})
    print("handle", text, flush=True)
    try:
        for line in sys.stdin:
            command, _, argument = line.strip().partition(" ")
            if command == "digest":
                print(digest(kv_cache.kv, [int(b) for b in argument.split(",")]), flush=True)
            elif command == "quit":
                break
    finally:
        if export.segment is not None:
            export.segment.remove()


def read_handle(lines: IO[str]) -> CacheHandle:
    for line in lines:
        if line.startswith("handle "):
            fields = json.loads(line.removeprefix("handle "))
            for name in ("memory_handle", "ref_counter_handle"):
                fields[name] = bytes.fromhex(fields[name])
            return CacheHandle(**fields)
    raise EOFError("the peer ended before it printed its handle")


def pieces(layout: KVCacheLayout, source_ids: list[int], max_chunk_bytes: int) -> list[KvPiece]:
    """Every layer's pieces of a sequence in `source_ids`, without their bytes (the copy only)."""
    step = blocks_per_piece(layout, max_chunk_bytes)
    return [
        KvPiece(layer, start, len(ids), EMPTY, EMPTY, tuple(ids))
        for layer in range(layout.num_layers)
        for start in range(0, len(source_ids), step)
        for ids in [source_ids[start : start + step]]
    ]


def timed_write(window: CacheWindow, all_pieces: list[KvPiece], num_layers: int) -> float:
    """Seconds to write every piece, waiting for each layer's copies as a transfer does."""
    started = time.perf_counter()
    for layer in range(num_layers):
        for piece in all_pieces:
            if piece.layer_index == layer:
                window.write(piece)
        window.wait()
    return time.perf_counter() - started


def run_size(args: argparse.Namespace, size_mib: int) -> dict[str, Any]:
    layout = layout_for(args.dtype)
    per_block = 2 * layout.num_layers * layout.block_nbytes
    num_seq_blocks = max(1, (size_mib << 20) // per_block)
    device = torch.device(args.device)
    source = KVCache(layout, 2 * num_seq_blocks, device)
    source.kv.normal_()
    local = KVCache(layout, 2 * num_seq_blocks + 1, device)
    source_ids = list(range(0, 2 * num_seq_blocks, 2))
    lease_ids = list(range(1, 2 * num_seq_blocks + 1, 2))
    process = subprocess.Popen(
        [sys.executable, __file__, "--peer", "--device", args.device, "--dtype", args.dtype,
         "--num-blocks", str(2 * num_seq_blocks + 1)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdin is not None and process.stdout is not None
    try:
        handle = read_handle(process.stdout)
        caches = MappedCaches(source)
        mapped = caches.open(handle).window(lease_ids, 0, source)
        in_process = CacheWindow(local.kv, lease_ids, 0, source)
        all_pieces = pieces(layout, source_ids, args.max_chunk_bytes)
        timed_write(mapped, all_pieces, layout.num_layers)  # warm-up
        timed_write(in_process, all_pieces, layout.num_layers)
        seconds: dict[str, list[float]] = {"cuda_ipc": [], "local": []}
        for _ in range(args.repeats):
            seconds["cuda_ipc"].append(timed_write(mapped, all_pieces, layout.num_layers))
            seconds["local"].append(timed_write(in_process, all_pieces, layout.num_layers))
        process.stdin.write(f"digest {','.join(map(str, lease_ids))}\n")
        process.stdin.flush()
        is_bit_exact = process.stdout.readline().strip() == digest(source.kv, source_ids)
    finally:
        if process.poll() is None:
            process.stdin.write("quit\n")
            process.stdin.close()
            process.wait(60)
    num_mib = num_seq_blocks * per_block / (1 << 20)
    mib_per_s = {way: num_mib / statistics.median(s) for way, s in seconds.items()}
    return {
        "size_mib": num_mib,
        "num_blocks": num_seq_blocks,
        "seconds": seconds,
        "mib_per_s": mib_per_s,
        "ratio_ipc_over_local": mib_per_s["cuda_ipc"] / mib_per_s["local"],
        "bit_exact": is_bit_exact,
        "device_kind": handle.device_kind,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=list(DEFAULT_SIZES_MIB))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-chunk-bytes", type=int, default=1 << 20)
    parser.add_argument("--device", default="cpu", help="both caches' device, e.g. cuda")
    parser.add_argument("--dtype", default="float32", help="the KV dtype, e.g. bfloat16")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON, last")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        peer(args.device, args.dtype, args.num_blocks)
        return
    rows = [run_size(args, size) for size in args.sizes_mib]
    print(f"{'MiB':>8} {'cuda_ipc MiB/s':>15} {'local MiB/s':>12} {'ipc/local':>10} {'exact':>6}")
    for row in rows:
        print(
            f"{row['size_mib']:>8.0f} {row['mib_per_s']['cuda_ipc']:>15.1f} "
            f"{row['mib_per_s']['local']:>12.1f} {row['ratio_ipc_over_local']:>10.2f} "
            f"{row['bit_exact']!s:>6}"
        )
    summary = {
        "device": args.device,
        "dtype": args.dtype,
        "device_kind": rows[0]["device_kind"],
        "cuda_ipc_mib_s": statistics.median(r["mib_per_s"]["cuda_ipc"] for r in rows),
        "local_mib_s": statistics.median(r["mib_per_s"]["local"] for r in rows),
        "median_ratio_ipc_over_local": statistics.median(r["ratio_ipc_over_local"] for r in rows),
        "bit_exact": all(r["bit_exact"] for r in rows),
        "sizes_mib": [r["size_mib"] for r in rows],
    }
    results = {"rows": rows, "summary": summary, "settings": vars(args)}
    print(f"results: {write_results('kv_cuda_ipc', results)}")
    if args.json:
        print(json.dumps(summary))
    if not summary["bit_exact"]:
        sys.exit("the peer's blocks differ from the source's")


if __name__ == "__main__":
    main()
