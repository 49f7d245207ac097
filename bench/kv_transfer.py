"""KV transfer: each transport into a real decode process vs a raw loopback TCP socket, same run.

    .venv/bin/python bench/kv_transfer.py                    # 16 .. 512 MiB, 3 repeats each
    .venv/bin/python bench/kv_transfer.py --sizes-mib 64 --repeats 3 --json
    .venv/bin/python bench/kv_transfer.py --sizes-mib 64 --repeats 9 --transports shm nixl
    python bench/kv_transfer.py --device cuda --dtype bfloat16 --sizes-mib 64 256 --json

For each size, one sequence's KV of that many bytes is moved from this process to another
process on the same host, several ways, alternating:

* the transports: a `pdserve-decode` process (launched as by `pdserve up`) leases the
  blocks with AllocateBlocks, then receives what this process sends with the prefill's own
  sender (`pdserve.prefill.kv.sender.KvSender` on the channel a prefill would open,
  `kv_transports.channels_for` with that one transport forced): the pieces are cut as the
  prefill's engine thread cuts them (`pdserve.kv.transfer`, at most
  ``--max-chunk-bytes`` of K+V each) and queued, then the clock runs while the sender ships
  them and the commit, until the decode acknowledges it. ``grpc``: SyncCache with the chunks in
  the stream (each copied and checksummed as it is written; the decode verifies and copies it
  into its cache). ``tcp``: the decode's data port (checksummed, sent from the cache; the
  decode reads each chunk straight into its cache and checksums it there). ``shm``: written
  into the decode's shared-memory cache (checksummed, copied once), then the commit's chunk
  list verified in the decode's cache. ``nixl``: one-sided NIXL WRITEs (UCX backend) from this
  process's registered cache into the decode's registered cache, each group of pieces posted at
  once and announced once it completed (checksummed here from the cache), then verified in the
  decode's cache like shm (offered where the ``nixl`` extra is installed; UCX picks its
  transport, shared memory between two processes of one host). Cutting the pieces (views of the
  cache) is timed apart.
* raw TCP: the same chunk bytes (K then V of every chunk, copied out beforehand) written with
  ``sendall`` to a receiver process that reads them into one preallocated buffer with
  ``recv_into`` and acknowledges the last byte: the floor for any transport over loopback TCP
  from Python.

SyncCache runs twice per repeat, into two decode processes: one with the internal plane in
plaintext (``--insecure``) and one with mutual TLS (certificates from a throwaway CA, the
sender presenting a prefill certificate), so the TLS cost is measured in the same run.
``--transports`` narrows the transports measured (raw TCP always runs; the TLS decode only
with ``grpc``).

The model is a random Llama built for a large KV per token (16 layers, 8 KV heads of 128,
float32: 128 KiB per token), so 512 MiB is a 4,096-token prompt. Reported: MiB/s per size
(median over repeats), the ratios SyncCache / TCP and SyncCache over mTLS / plaintext, and the
cut time. With ``--device cuda`` both caches are on the GPU: the decode then offers ``cuda_ipc``
(its cache mapped here, the pieces copied device to device, checksummed in its cache), its TCP
data port (read through pinned host buffers) and gRPC (shared memory needs a CPU cache), and a
raw device-to-host copy of the same blocks (``d2h``, what any transport pays first) and an
in-process device-to-device copy of them into another cache on the same GPU (``d2d``, what
nixl's VRAM-to-VRAM WRITEs are held against) are timed
beside raw TCP. Results go
to bench/results/kv_transfer-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from common import server_logs, write_results

from pdserve.common.generation import SamplingParams, num_blocks_for
from pdserve.common.pki import MEMBER_DNS_NAME, Identity, instance_dns_name
from pdserve.common.security import Security
from pdserve.engine.kv_cache import KVCache, KVCacheLayout
from pdserve.kv.transfer import sequence_pieces
from pdserve.kv.transports.cuda_ipc_window import MappedCaches
from pdserve.launcher import certs
from pdserve.launcher.child import ChildProcess
from pdserve.prefill import convert
from pdserve.prefill.kv.nixl import NixlSide
from pdserve.prefill.kv.sender import KvSender
from pdserve.prefill.kv.shm import SharedPools
from pdserve.prefill.kv.transports import channels_for
from pdserve.prefill.request import Request
from pdserve.serving.convert import local_protocol
from pdserve.v1 import decode_pb2_grpc, instance_pb2, instance_pb2_grpc

MIB = 1 << 20
BLOCK_SIZE = 16
DEFAULT_SIZES_MIB = (16, 32, 64, 128, 256, 512)
MODEL_SHAPE = {"num_layers": 16, "num_kv_heads": 8, "head_dim": 128}
VOCAB_SIZE = 512
TRANSPORTS = ("grpc", "tcp", "shm", "nixl", "cuda_ipc")
WARMUP_TRANSFERS = 1

# The receiver of the raw TCP baseline: a separate process, like the decode. It prints its port,
# then per connection reads an 8-byte length and that many bytes into one buffer, and acks. It
# exits when its standard input closes (the bench ended, however it ended) and on a payload it
# cannot hold; a connection closed mid-payload is dropped.
TCP_RECEIVER = r"""
import os, socket, struct, sys, threading
threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
server.bind(("127.0.0.1", 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
buffer = memoryview(bytearray(int(sys.argv[1])))
while True:
    conn, _ = server.accept()
    size = struct.unpack("!Q", conn.recv(8, socket.MSG_WAITALL))[0]
    if size > len(buffer):
        sys.exit(f"a payload of {size} bytes does not fit the receiver's {len(buffer)}")
    received = 0
    while received < size:
        got = conn.recv_into(buffer[received:size])
        if got == 0:
            break
        received += got
    if received == size:
        conn.sendall(b"k")
    conn.close()
"""


def build_kv_model(path: Path) -> Path:
    """A random Llama whose KV is 128 KiB per token (weights are small: hidden 256)."""
    if (path / "config.json").is_file():
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=MODEL_SHAPE["num_layers"],
        num_attention_heads=MODEL_SHAPE["num_kv_heads"],
        num_key_value_heads=MODEL_SHAPE["num_kv_heads"],
        head_dim=MODEL_SHAPE["head_dim"],
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def bytes_per_token(dtype: str = "float32") -> int:
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    shape = MODEL_SHAPE
    return 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * itemsize


class Decode:
    """A `pdserve-decode` process and channels to it: as a prefill (KV) and as an operator.

    Args:
        is_tls: Mutual TLS under a throwaway CA in `log_dir`; plaintext (``--insecure``) if not.
    """

    def __init__(
        self, model: Path, num_blocks: int, log_dir: Path, is_tls: bool, layout: KVCacheLayout,
        device: str,
    ) -> None:  # fmt: skip
        name = "decode-tls" if is_tls else "decode-plain"
        argv = [sys.executable, "-m", "pdserve.decode", "--model", str(model), "--port", "0",
                "--num-blocks", str(num_blocks), "--lease-ttl-ms", "120000",
                "--max-model-len", "8192", "--log-level", "info", "--device", device,
                "--dtype", layout.dtype]  # fmt: skip
        sender, operator = Security.insecure(), Security.insecure()
        if is_tls:
            ids = [Identity("decode", name), Identity("prefill", "prefill-bench"),
                   Identity("client", "client-bench")]  # fmt: skip
            files = certs.throwaway(log_dir / "tls", ids)
            argv += ["--tls-ca", str(files[name].ca), "--tls-cert", str(files[name].cert),
                     "--tls-key", str(files[name].key)]  # fmt: skip
            sender, operator = (
                Security.from_files(f.ca, f.cert, f.key)
                for f in (files["prefill-bench"], files["client-bench"])
            )
        else:
            argv.append("--insecure")
        self.child = ChildProcess(name, argv, log_dir / f"{name}.log")
        started = self.child.wait_for_event("decode_started", 120)
        self.address = str(started["address"])
        self.transports = [str(kind) for kind in started["kv_transports"]]
        self.channel = sender.channel(self.address, instance_dns_name("decode", name))
        self.status_channel = operator.channel(self.address, MEMBER_DNS_NAME)
        self.stub = decode_pb2_grpc.DecodeServiceStub(self.channel)
        self.pools = SharedPools(layout)
        self.caches: dict[int, MappedCaches] = {}
        self.status = instance_pb2_grpc.InstanceServiceStub(self.status_channel)

    async def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Waits until every block is free again (the last transfer's request has ended)."""
        deadline = time.monotonic() + timeout_s
        request = instance_pb2.GetInstanceStatusRequest(check_integrity=True)
        while True:
            pool = (await self.status.GetInstanceStatus(request, timeout=5)).pool
            if pool.num_free_blocks == pool.num_total_blocks and not pool.num_open_leases:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the decode pool did not drain: {pool}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.channel.close()
        await self.status_channel.close()
        self.child.signal(15)
        self.child.wait(20)
        self.child.close()


async def sync_cache_once(
    decode: Decode,
    kv_cache: KVCache,
    num_tokens: int,
    max_chunk_bytes: int,
    request_id: str,
    transport: str = "grpc",
    nixl: NixlSide | None = None,
) -> tuple[float, float, int]:
    """One lease + transfer of `num_tokens` tokens' KV on `transport`, sent by the prefill's
    `KvSender`.

    Returns:
        (transfer seconds, piece cutting seconds, K+V bytes sent).
    """
    status = await decode.status.GetInstanceStatus(instance_pb2.GetInstanceStatusRequest())
    request = Request(
        request_id=request_id,
        token_ids=[5] * num_tokens,
        num_prompt_tokens=num_tokens,
        sampling=SamplingParams(temperature=0.0, max_tokens=2),
        seed=0,
        decode_address=decode.address,
        block_ids=list(range(num_blocks_for(num_tokens, BLOCK_SIZE))),
    )
    allocate = convert.allocate_request(
        request, status.instance.kv_layout, local_protocol(), sender="bench"
    )
    response = await decode.stub.AllocateBlocks(allocate, timeout=30)
    request.lease = convert.lease_from_proto(response.lease)
    # NOTE: one mapping per decode and sender cache, opened in the warm-up, as a prefill keeps it.
    caches = decode.caches.setdefault(id(kv_cache), MappedCaches(kv_cache))
    channels = channels_for(request, decode.stub, decode.pools, [transport], caches, nixl)
    sender = KvSender(request, channels)
    began = time.perf_counter()
    for piece in sequence_pieces(kv_cache, request.block_ids, max_chunk_bytes):
        sender.put(piece)
    sender.commit(7, request.first_token_index)
    cut_s = time.perf_counter() - began
    began = time.perf_counter()
    result = await sender.run()
    transfer_s = time.perf_counter() - began
    if result.transport != transport:
        raise RuntimeError(f"asked for {transport}, the transfer used {result.transport}")
    await decode.wait_idle()
    return transfer_s, cut_s, result.num_bytes


def chunk_payloads(kv_cache: KVCache, num_tokens: int, max_chunk_bytes: int) -> list[bytes]:
    """The K and V byte strings of every chunk SyncCache sends, in order."""
    block_ids = list(range(num_blocks_for(num_tokens, BLOCK_SIZE)))
    payloads = []
    for piece in sequence_pieces(kv_cache, block_ids, max_chunk_bytes):
        payloads += [bytes(piece.key), bytes(piece.value)]
    return payloads


def d2h_once(kv_cache: KVCache, num_tokens: int, max_chunk_bytes: int) -> float:
    """Seconds to copy the chunks' blocks from the GPU into host memory (no transport)."""
    block_ids = list(range(num_blocks_for(num_tokens, BLOCK_SIZE)))
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in sequence_pieces(kv_cache, block_ids, max_chunk_bytes):
        pass  # NOTE: each piece of a CUDA cache is copied to host memory as it is cut
    return time.perf_counter() - began


def d2d_once(kv_cache: KVCache, num_tokens: int, into: KVCache) -> float:
    """Seconds to copy the sequence's blocks of every layer into `into` on the same device, in
    this process (one copy per layer's K and V runs)."""
    num_blocks = num_blocks_for(num_tokens, BLOCK_SIZE)
    torch.cuda.synchronize()
    began = time.perf_counter()
    # kv: [num_layers, 2, num_blocks, ...]: the first num_blocks of every layer's K and V
    into.kv[:, :, :num_blocks].copy_(kv_cache.kv[:, :, :num_blocks])
    torch.cuda.synchronize()
    return time.perf_counter() - began


def tcp_once(port: int, payloads: list[bytes]) -> float:
    """Sends `payloads` to the receiver process; seconds until it acknowledged the last byte."""
    began = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(struct.pack("!Q", sum(len(p) for p in payloads)))
        for payload in payloads:
            sock.sendall(payload)
        if sock.recv(1) != b"k":
            raise RuntimeError("the TCP receiver did not acknowledge")
    return time.perf_counter() - began


def start_tcp_receiver(max_bytes: int) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, "-c", TCP_RECEIVER, str(max_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], 30)
    if not ready:
        process.kill()
        raise RuntimeError("the TCP receiver did not start")
    return process, int(process.stdout.readline())


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with server_logs("bench-kv-logs-") as logs:
        return await measure(args, logs)


async def measure(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """`run`'s rows, with the decodes' logs in `log_dir`."""
    from pdserve.common.env import cache_dir

    model = build_kv_model(cache_dir() / "bench-kv-llama-v1")
    per_token = bytes_per_token(args.dtype)
    max_tokens = max(args.sizes_mib) * MIB // per_token
    num_blocks = num_blocks_for(max_tokens, BLOCK_SIZE) + 8
    layout = KVCacheLayout(block_size=BLOCK_SIZE, dtype=args.dtype, **MODEL_SHAPE)
    kv_cache = KVCache(layout, num_blocks_for(max_tokens, BLOCK_SIZE), torch.device(args.device))
    kv_cache.kv.normal_()  # stands in for a computed prompt: what the bytes are does not matter
    decode = Decode(model, num_blocks, log_dir, False, layout, args.device)
    is_grpc = "grpc" in args.transports
    decode_tls = Decode(model, num_blocks, log_dir, True, layout, args.device) if is_grpc else None
    transports = [way for way in TRANSPORTS if way in decode.transports and way in args.transports]
    # NOTE: SyncCache over mutual TLS, beside plaintext gRPC when that is measured.
    tls_ways = ["grpc_tls"] if decode_tls is not None else []
    # NOTE: this process's agent, as a prefill's: its cache registered once.
    nixl = NixlSide(kv_cache) if "nixl" in transports else None
    is_cuda = kv_cache.device.type == "cuda"
    baselines = ["raw_tcp"] + (["d2h", "d2d"] if is_cuda else [])
    # NOTE: the d2d copy's destination, a second cache of the same shape on the same GPU.
    d2d_target = KVCache(layout, kv_cache.num_blocks, kv_cache.device) if is_cuda else None
    # NOTE: the payloads are whole blocks (a size below a block's bytes sends the whole
    # block): the largest is the whole cache.
    receiver, port = start_tcp_receiver(kv_cache.nbytes)
    rows = []
    try:
        # NOTE: a transfer of the smallest size each way first (connections, allocator, code
        # paths warm). gRPC still runs the whole first size measured at about a third of its
        # later speed, whatever the size and however many warm-up transfers (1 to 4 tried):
        # run several sizes (the default) to see its steady speed.
        warm = min(args.sizes_mib) * MIB // per_token
        tcp_once(port, chunk_payloads(kv_cache, warm, args.max_chunk_bytes))
        for i in range(WARMUP_TRANSFERS):
            if decode_tls is not None:
                await sync_cache_once(
                    decode_tls, kv_cache, warm, args.max_chunk_bytes, f"warmup-tls-{i}"
                )
            for transport in transports:
                await sync_cache_once(
                    decode, kv_cache, warm, args.max_chunk_bytes, f"warmup-{transport}-{i}",
                    transport, nixl,
                )  # fmt: skip
        for size_mib in args.sizes_mib:
            num_tokens = size_mib * MIB // per_token
            payloads = chunk_payloads(kv_cache, num_tokens, args.max_chunk_bytes)
            ways = [*transports, *tls_ways, *baselines]
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            cut_s = []
            num_bytes = 0
            for repeat in range(args.repeats):
                # NOTE: the order rotates per repeat, so no way always runs first or last.
                for way in ways[repeat % len(ways) :] + ways[: repeat % len(ways)]:
                    request_id = f"kv-{size_mib}-{repeat}-{way}"
                    if way == "raw_tcp":
                        seconds[way].append(tcp_once(port, payloads))
                        continue
                    if way == "d2h":
                        seconds[way].append(d2h_once(kv_cache, num_tokens, args.max_chunk_bytes))
                        continue
                    if way == "d2d":
                        assert d2d_target is not None
                        seconds[way].append(d2d_once(kv_cache, num_tokens, d2d_target))
                        continue
                    if way == "grpc_tls":
                        assert decode_tls is not None
                        target, transport = decode_tls, "grpc"
                    else:
                        target, transport = decode, way
                    took, cut, num_bytes = await sync_cache_once(
                        target, kv_cache, num_tokens, args.max_chunk_bytes, request_id, transport,
                        nixl,
                    )  # fmt: skip
                    seconds[way].append(took)
                    cut_s.append(cut)
            assert num_bytes == sum(len(p) for p in payloads)
            mib_s = {
                way: round(num_bytes / MIB / statistics.median(times), 1)
                for way, times in seconds.items()
            }
            row = {
                "size_mib": size_mib,
                "num_tokens": num_tokens,
                "num_bytes": num_bytes,
                "num_chunks": len(payloads) // 2,
                "seconds": seconds,
                "cut_s": cut_s,
                "mib_per_s": mib_s,
                "ratio_over_raw_tcp": {
                    way: round(mib_s[way] / mib_s["raw_tcp"], 3) for way in (*transports, *tls_ways)
                },
                "ratio_tls_over_plain": round(mib_s["grpc_tls"] / mib_s["grpc"], 3)
                if tls_ways
                else None,
            }
            rows.append(row)
            ratios = row["ratio_over_raw_tcp"]
            print(
                f"{size_mib:>6} MiB  raw TCP {mib_s['raw_tcp']:>8.1f} MiB/s  "
                + "  ".join(
                    f"{way} {mib_s[way]:>8.1f} ({ratios[way]:.2f}x)"
                    for way in (*transports, *tls_ways)
                )
                + (f"  d2h {mib_s['d2h']:>8.1f}" if "d2h" in mib_s else "")
                + (f"  d2d {mib_s['d2d']:>8.1f}" if "d2d" in mib_s else "")
                + f"  cut {statistics.median(cut_s):.2f} s",
                flush=True,
            )
    finally:
        receiver.kill()
        receiver.wait()
        await decode.close()
        if decode_tls is not None:
            await decode_tls.close()
        if nixl is not None:
            nixl.close()
    return {
        "command": " ".join(sys.argv[1:]),
        "device": args.device,
        "dtype": args.dtype,
        "transports": transports,
        "max_chunk_bytes": args.max_chunk_bytes,
        "repeats": args.repeats,
        "bytes_per_token": per_token,
        "rows": rows,
        "median_ratio_tls_over_plain": statistics.median(r["ratio_tls_over_plain"] for r in rows)
        if is_grpc
        else None,
    }


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The one-object summary `--json` prints: MiB/s and ratio over raw TCP per transport,
    medians over the sizes run (each size's figure is the median of its repeats)."""
    rows = results["rows"]
    return {
        "device": results["device"],
        "dtype": results["dtype"],
        "raw_tcp_mib_s": statistics.median(r["mib_per_s"]["raw_tcp"] for r in rows),
        "d2h_mib_s": statistics.median(r["mib_per_s"]["d2h"] for r in rows)
        if "d2h" in rows[0]["mib_per_s"]
        else None,
        "d2d_mib_s": statistics.median(r["mib_per_s"]["d2d"] for r in rows)
        if "d2d" in rows[0]["mib_per_s"]
        else None,
        "transports": {
            way: {
                "mib_s": statistics.median(r["mib_per_s"][way] for r in rows),
                "ratio": statistics.median(r["ratio_over_raw_tcp"][way] for r in rows),
            }
            for way in results["transports"]
        },
        "sizes_mib": [r["size_mib"] for r in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=list(DEFAULT_SIZES_MIB))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-chunk-bytes", type=int, default=1 << 20, help="as the prefill's flag (1 MiB)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the summary as one JSON object, last"
    )
    parser.add_argument("--device", default="cpu", help="both KV caches' device, e.g. cuda")
    parser.add_argument("--dtype", default="float32", help="the KV dtype, e.g. bfloat16")
    parser.add_argument(
        "--transports",
        nargs="+",
        default=list(TRANSPORTS),
        choices=TRANSPORTS,
        help="the transports to measure (all the decode offers); raw TCP always runs",
    )
    args = parser.parse_args()
    results = asyncio.run(run(args))
    results["summary"] = summary(results)
    for way, figures in results["summary"]["transports"].items():
        print(f"{way}: {figures['mib_s']:.1f} MiB/s, {figures['ratio']:.2f}x raw TCP")
    print(f"results: {write_results('kv_transfer', results)}")
    if args.json:
        print(json.dumps(results["summary"]))


if __name__ == "__main__":
    main()
