"""How much of the KV transfer the prefill's computation hides (layer-wise push), per transport.

    .venv/bin/python bench/kv_overlap.py                       # real model, 2,048 tokens
    .venv/bin/python bench/kv_overlap.py --prompt-tokens 1024 --repeats 5 --json

One `pdserve-decode` and one `pdserve-prefill` per transport (forced with `--kv-transports`)
run as processes on the default real model (SmolLM2-135M-Instruct), as `pdserve up` starts them.
This process calls `PrefillService.Prefill` straight, with the decode as target, and reads the
phases the prefill reports with `handed_off` (`PrefillPhases`, timed inside the prefill):
`compute_us` up to the first token, and `transfer_tail_us` from the first token to the decode's
acknowledgement of the KV commit: the part of the transfer that computation did not hide.

The transfer's whole length, for the same bytes on the same transport and into the same
decode, is measured right after each prompt as `bench/kv_transfer.py` measures it: this process
leases as many blocks and sends a cache of the model's layout with the prefill's own sender
(`KvSender` on the forced channel), pieces queued at once, the clock running until the commit
is acknowledged. Hidden fraction = 1 - tail / whole transfer (medians over repeats, each repeat
a fresh random prompt). Also printed: the prompt's compute time and the KV bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
import torch
from common import write_results
from kv_transfer import sync_cache_once

from pdserve.common.generation import SamplingParams, num_blocks_for
from pdserve.common.grpc_server import insecure_channel
from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model
from pdserve.kv.transports.cuda_ipc_window import MappedCaches
from pdserve.kv.transports.nixl import is_installed as nixl_installed
from pdserve.launcher.child import ChildProcess
from pdserve.prefill.kv.nixl import NixlSide
from pdserve.prefill.kv.shm import SharedPools
from pdserve.serving.convert import local_protocol, sampling_to_proto
from pdserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    instance_pb2,
    instance_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

# NOTE: nixl where its extra is installed (pdserve.kv.transports.nixl).
TRANSPORTS = ("grpc", "tcp", "shm", *(("nixl",) if nixl_installed() else ()))
SAMPLING = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


class TransferTarget:
    """The decode as `bench/kv_transfer.py`'s `sync_cache_once` drives it (plaintext plane)."""

    def __init__(self, address: str, channel: grpc.aio.Channel, layout: KVCacheLayout) -> None:
        self.address = address
        self.channel = channel
        self.stub = decode_pb2_grpc.DecodeServiceStub(channel)
        self.status = instance_pb2_grpc.InstanceServiceStub(channel)
        self.layout = layout
        self.pools = SharedPools(layout)
        self.caches: dict[int, MappedCaches] = {}

    @classmethod
    async def connect(cls, address: str) -> TransferTarget:
        channel = insecure_channel(address)
        status = await instance_pb2_grpc.InstanceServiceStub(channel).GetInstanceStatus(
            instance_pb2.GetInstanceStatusRequest()
        )
        proto = status.instance.kv_layout
        layout = KVCacheLayout(
            num_layers=proto.num_layers,
            num_kv_heads=proto.num_kv_heads,
            head_dim=proto.head_dim,
            block_size=proto.block_size,
            dtype=common_pb2.KvDtype.Name(proto.dtype).removeprefix("KV_DTYPE_").lower(),
        )
        return cls(address, channel, layout)

    async def wait_idle(self) -> None:
        """Releases nothing: the leases end by themselves (TTL) and the pool is large."""


def spawn(name: str, module: str, args: list[str], log_dir: Path) -> tuple[ChildProcess, str, str]:
    """Starts an instance; returns it with its address and instance id."""
    argv = [sys.executable, "-m", module, "--port", "0", "--insecure", "--log-level", "info",
            *args]  # fmt: skip
    child = ChildProcess(name, argv, log_dir / f"{name}.log")
    started = child.wait_for_event(f"{module.rsplit('.', 1)[-1]}_started", 300)
    return child, str(started["address"]), str(started["instance_id"])


async def prefill_once(
    stub: prefill_pb2_grpc.PrefillServiceStub,
    request_id: str,
    prompt: list[int],
    decode_address: str,
    decode_id: str,
) -> dict[str, Any]:
    """One Prefill stream: seconds to the first token, the transfer tail, bytes, transport."""
    message = prefill_pb2.PrefillRequest(
        request_id=request_id,
        token_ids=prompt,
        sampling=sampling_to_proto(SAMPLING),
        decode=prefill_pb2.DecodeTarget(address=decode_address, instance_id=decode_id),
        protocol=local_protocol(),
    )
    handed_off = None
    async for response in stub.Prefill(message):
        if response.WhichOneof("event") == "handed_off":
            handed_off = response.handed_off
    assert handed_off is not None, "the prefill did not hand off"
    assert handed_off.HasField("phases"), "the prefill reports no phases"
    return {
        "compute_s": handed_off.phases.compute_us / 1e6,
        "tail_s": handed_off.phases.transfer_tail_us / 1e6,
        "num_bytes": handed_off.num_bytes,
        "transport": handed_off.transport,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    resolved = resolve_model(args.model, show_progress=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-kv-overlap-"))
    common = ["--model", str(resolved.path), "--max-model-len", str(args.prompt_tokens + 64)]
    children: list[ChildProcess] = []
    channels: list[grpc.aio.Channel] = []
    target: TransferTarget | None = None
    try:
        decode, decode_address, decode_id = spawn(
            "decode", "pdserve.decode", [*common, "--num-blocks", "1024"], log_dir
        )
        children.append(decode)
        stubs = {}
        transports = tuple(args.transports)
        for transport in transports:
            prefill, address, _ = spawn(
                f"prefill-{transport}",
                "pdserve.prefill",
                [*common, "--kv-transports", transport,
                 "--max-num-batched-tokens", str(args.prompt_tokens + 64)],
                log_dir,
            )  # fmt: skip
            children.append(prefill)
            channels.append(insecure_channel(address))
            stubs[transport] = prefill_pb2_grpc.PrefillServiceStub(channels[-1])
        target = await TransferTarget.connect(decode_address)
        kv_cache = KVCache(
            target.layout,
            num_blocks_for(args.prompt_tokens, target.layout.block_size),
            torch.device("cpu"),
        )
        kv_cache.kv.normal_()
        nixl = NixlSide(kv_cache) if "nixl" in transports else None
        rng = random.Random(0)
        vocab = 40_000
        samples: dict[str, list[dict[str, Any]]] = {t: [] for t in transports}
        for repeat in range(-1, args.repeats):  # repeat -1 warms every path up
            turn = repeat % len(transports)
            order = transports[turn:] + transports[:turn]
            for transport in order:
                prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
                cold = await prefill_once(
                    stubs[transport],
                    f"cold-{transport}-{repeat}",
                    prompt,
                    decode_address,
                    decode_id,
                )
                alone_s, _, num_bytes = await sync_cache_once(
                    target, kv_cache, args.prompt_tokens, 1 << 20, f"alone-{transport}-{repeat}",
                    transport, nixl,
                )  # fmt: skip
                assert num_bytes == cold["num_bytes"], (num_bytes, cold["num_bytes"])
                if repeat >= 0:
                    samples[transport].append({"cold": cold, "alone_s": alone_s})
                # NOTE: the leases are never attached by a Generate; their TTL reclaims them.
        rows = {}
        for transport, runs in samples.items():
            cold_tail = statistics.median(r["cold"]["tail_s"] for r in runs)
            alone = statistics.median(r["alone_s"] for r in runs)
            rows[transport] = {
                "compute_ms": round(
                    1000 * statistics.median(r["cold"]["compute_s"] for r in runs), 1
                ),
                "cold_tail_ms": round(1000 * cold_tail, 2),
                "alone_ms": round(1000 * alone, 2),
                "hidden": round(1 - cold_tail / alone, 3) if alone else None,
                "num_bytes": runs[0]["cold"]["num_bytes"],
                "transport": runs[0]["cold"]["transport"],
                "runs": runs,
            }
            row = rows[transport]
            print(
                f"{transport:>5}: compute {row['compute_ms']:>7.1f} ms  tail after compute "
                f"{row['cold_tail_ms']:>6.2f} ms  transfer alone {row['alone_ms']:>6.2f} ms"
                f"  hidden {row['hidden']:.0%}  ({row['num_bytes'] / 2**20:.1f} MiB)",
                flush=True,
            )
    finally:
        if target is not None:
            await target.channel.close()
        for channel in channels:
            await channel.close()
        for child in reversed(children):
            child.signal(15)
            child.wait(30)
            child.close()
    return {
        "command": " ".join(sys.argv[1:]),
        "model": resolved.name,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--transports",
        nargs="+",
        choices=TRANSPORTS,
        default=list(TRANSPORTS),
        help="the transports to measure, each with its own prefill and decode (default: all)",
    )
    parser.add_argument("--json", action="store_true", help="print a summary object last")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    print(f"results: {write_results('kv_overlap', results)}")
    if args.json:
        summary = {t: {k: r[k] for k in ("hidden", "cold_tail_ms", "alone_ms", "compute_ms")}
                   for t, r in results["rows"].items()}  # fmt: skip
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
