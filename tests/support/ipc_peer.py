"""A process that holds an exported KV cache, the decode's side of the cuda_ipc exchange, for
tests that map it from another process.

    python tests/support/ipc_peer.py DEVICE NUM_BLOCKS LAYOUT_JSON

Prints ``handle `` and the cache handle as JSON on one line (bytes as hex; log lines may come
before it). Then, for each line read from stdin: ``digest ID,ID,...`` prints the SHA-256 of
those blocks (every layer, K then V, in that order); ``quit`` (or the end of stdin) exits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from typing import IO

import torch

from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transports.cuda_ipc import CacheHandle, export_cache


def handle_to_json(handle: CacheHandle) -> str:
    """One line of JSON for `handle` (bytes as hex)."""
    fields = dataclasses.asdict(handle)
    return json.dumps({k: v.hex() if isinstance(v, bytes) else v for k, v in fields.items()})


def read_handle(lines: IO[str]) -> CacheHandle:
    """The handle the peer printed on `lines` (its stdout)."""
    for line in lines:
        if line.startswith("handle "):
            return handle_from_json(line.removeprefix("handle "))
    raise EOFError("the peer ended before it printed its handle")


def handle_from_json(text: str) -> CacheHandle:
    """The handle `handle_to_json` wrote."""
    fields = json.loads(text)
    for name in ("memory_handle", "ref_counter_handle"):
        fields[name] = bytes.fromhex(fields[name])
    return CacheHandle(**fields)


def blocks_digest(kv: torch.Tensor, block_ids: list[int]) -> str:
    """SHA-256 of blocks `block_ids` of a ``[layers, 2, blocks, ...]`` cache, layer by layer,
    K then V."""
    digest = hashlib.sha256()
    index = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
    for layer in range(kv.shape[0]):
        for kv_index in (0, 1):
            blocks = kv[layer, kv_index].index_select(0, index).cpu().contiguous()
            digest.update(blocks.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    device, num_blocks, layout_json = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    layout = KVCacheLayout(**json.loads(layout_json))
    kv_cache = KVCache(layout, num_blocks, torch.device(device))
    export = export_cache(kv_cache)
    print("handle", handle_to_json(export.handle), flush=True)
    try:
        for line in sys.stdin:
            command, _, argument = line.strip().partition(" ")
            if command == "digest":
                ids = [int(b) for b in argument.split(",")]
                print(blocks_digest(kv_cache.kv, ids), flush=True)
            elif command == "quit":
                break
    finally:
        if export.segment is not None:
            export.segment.remove()


if __name__ == "__main__":
    main()
