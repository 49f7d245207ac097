"""Decode throughput of the decode service vs the colocated engine, in the same run.

For each concurrency N, N prompts are prefilled locally, their KV shipped to a real decode
server over SyncCache (the prefill's stream, `pdserve.prefill.kv.sender.sync_cache_messages`),
and N Generate streams read to the end; decode tokens/s counts the
tokens after the first. The baseline is `LLMEngine` decoding the same N requests in-process
(timed from when every prompt has its first token). Both use one torch thread. Run:

    .venv/bin/python bench/decode.py [--concurrency 1 8 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from common import build_random_llama, write_results

from pdserve.common.generation import SamplingParams, num_blocks_for
from pdserve.common.grpc_server import insecure_channel
from pdserve.decode.config import DecodeConfig
from pdserve.decode.server import create_server
from pdserve.engine.batch import ScheduledChunk
from pdserve.engine.block_pool import BlockPool
from pdserve.engine.colocated import LLMEngine
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.prefill import convert
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.kv.sender import sync_cache_messages
from pdserve.prefill.request import Request
from pdserve.serving.convert import local_protocol
from pdserve.serving.model_host import ModelHost
from pdserve.v1 import decode_pb2, decode_pb2_grpc

BLOCK_SIZE = 16
PROMPT_LEN = 64
MAX_CHUNK_BYTES = PrefillConfig(insecure=True).max_chunk_bytes


def _load(model_dir: Path, num_blocks: int) -> ModelHost:
    return ModelHost.load(
        str(model_dir), "bench", num_blocks=num_blocks, kv_cache_memory_mb=1,
        block_size=BLOCK_SIZE, dtype="float32", device="cpu", max_model_len=None,
        num_threads=1,
    )  # fmt: skip


def _prompts(n: int) -> list[list[int]]:
    return [[(97 * i + 13 * j) % 2000 + 3 for j in range(PROMPT_LEN)] for i in range(n)]


async def service_tokens_per_s(model_dir: Path, n: int, sampling: SamplingParams) -> float:
    host = _load(model_dir, num_blocks=64 * 32)
    sender = _load(model_dir, num_blocks=64 * 32)
    pool = BlockPool(sender.num_blocks)
    config = DecodeConfig(
        port=0, block_size=BLOCK_SIZE, max_num_seqs=64, lease_ttl_ms=600_000, insecure=True
    )
    instance = await create_server(config, host)
    stub = decode_pb2_grpc.DecodeServiceStub(insecure_channel(f"127.0.0.1:{instance.port}"))
    leases = []
    for i, prompt in enumerate(_prompts(n)):
        block_ids = pool.allocate(num_blocks_for(PROMPT_LEN, BLOCK_SIZE))
        logits = sender.runner.execute([ScheduledChunk(prompt, 0, block_ids)])
        first = int(logits[0].argmax())
        request = Request(
            request_id=f"r{i}", token_ids=prompt, num_prompt_tokens=PROMPT_LEN,
            sampling=sampling, seed=0, decode_address="", block_ids=block_ids,
        )  # fmt: skip
        allocate = convert.allocate_request(request, sender.kv_layout, local_protocol(), "bench")
        request.lease = convert.lease_from_proto((await stub.AllocateBlocks(allocate)).lease)
        leases.append((request, first))

    async def run(request: Request, first: int) -> int:
        messages = sync_cache_messages(request, sender.runner.kv_cache, first, MAX_CHUNK_BYTES)
        await stub.SyncCache(iter(list(messages)))
        assert request.lease is not None
        count = 0
        generate = decode_pb2.DecodeServiceGenerateRequest(lease_id=request.lease.lease_id)
        async for message in stub.Generate(generate):
            count += len(message.tokens.token_ids)
        return count

    start = time.perf_counter()
    counts = await asyncio.gather(*(run(*item) for item in leases))
    elapsed = time.perf_counter() - start
    await instance.stop(grace=None)
    return sum(counts) / elapsed


def engine_tokens_per_s(model_dir: Path, n: int, sampling: SamplingParams) -> float:
    config = EngineConfig(
        model=str(model_dir),
        num_threads=1,
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=64 * 32),
    )
    engine = LLMEngine(config)
    for i, prompt in enumerate(_prompts(n)):
        engine.add_request(f"r{i}", prompt, sampling)
    num_first = 0
    while num_first < n:  # prefill everything first: only decode steps are timed
        num_first += sum(1 for out in engine.step() if out.new_token_ids)
    num_tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
    return num_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="runs per side (median)")
    parser.add_argument("--model-dir", type=Path, default=None, help="reuse a checkpoint")
    args = parser.parse_args()
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_llama(args.model_dir or Path(tmp) / "model")
        engine_tokens_per_s(model_dir, 2, sampling)  # warm-up: first passes are slow
        rows = []
        for n in args.concurrency:
            # NOTE: alternate the two sides and keep the median of three runs each.
            baseline, service = [], []
            for _ in range(args.repeat):
                baseline.append(engine_tokens_per_s(model_dir, n, sampling))
                service.append(asyncio.run(service_tokens_per_s(model_dir, n, sampling)))
            rows.append(
                {
                    "concurrency": n,
                    "service_tok_s": statistics.median(service),
                    "engine_tok_s": statistics.median(baseline),
                }
            )
    print(f"{'running':>8} {'decode service tok/s':>21} {'LLMEngine tok/s':>16} {'ratio':>6}")
    for row in rows:
        ratio = row["service_tok_s"] / row["engine_tok_s"]
        row["ratio"] = ratio
        print(
            f"{row['concurrency']:>8} {row['service_tok_s']:>21.1f} "
            f"{row['engine_tok_s']:>16.1f} {ratio:>6.2f}"
        )
    print("results:", write_results("decode", {"rows": rows, "max_tokens": args.max_tokens}))


if __name__ == "__main__":
    main()
