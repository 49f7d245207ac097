"""Resume after preemption: the stall a stream sees, KV store vs recompute, one run, real model.

    .venv/bin/python bench/kv_resume.py                          # 256 .. 2,048-token contexts
    .venv/bin/python bench/kv_resume.py --contexts 512 1024 --repeats 2

Three clusters of real services (gateway, one prefill, one decode, in this process, on the
default model, SmolLM2-135M-Instruct) run side by side; the workload alternates between them:

* ``recompute``: no store, the prefill's prefix cache off: a rescheduled request computes its
  whole context (prompt + tokens generated so far) again, as before the storage tier;
* ``store``: ``--kv-store file:DIR``, prefix cache off: the decode offloads the preempted
  request's blocks, the prefill loads them and computes only what follows;
* ``prefix_cache``: no store, prefix cache on (the default): the prefill still holds the
  prompt's blocks from the first pass, so only the generated part is recomputed (one prefill:
  the reschedule always lands where the prompt was computed).

For each context length, a greedy completion (prompt of that many token ids, 32 new tokens)
is streamed; after 16 tokens the decode is told to preempt everything (as when its pool runs
out), the gateway reschedules, and the stall is the longest gap between token chunks from the
preemption on (client side): the wait from the notice to the rescheduled attempt's first
token. Reported: median stall per setup and
context, and the ratio store / recompute. Outputs are checked equal across setups. Results
go to bench/results/kv_resume-<time>.json.

Then a preemption storm: ``--storm-streams`` streams of 32-token prompts and ``--storm-tokens``
new tokens at once on a decode of ``--storm-blocks`` blocks (no growth headroom), so they
preempt each other over and over; reported are the prompt tokens the prefill computed with and
without the store (prefix cache off in both), and whether every output equals the same
request's on an undisturbed cluster. ``--storm-only`` runs just that.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
from common import write_results

from pdserve.decode.config import DecodeConfig
from pdserve.decode.events import PreemptionReason
from pdserve.decode.server import DecodeInstance
from pdserve.decode.server import create_server as create_decode
from pdserve.engine.model_store import DEFAULT_MODEL, resolve_model
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.server import GatewayServer
from pdserve.prefill.config import PrefillConfig
from pdserve.prefill.server import create_server as create_prefill

MAX_TOKENS = 32
PREEMPT_AFTER = 16


class Setup:
    """One gateway, prefill and decode, in this process, on the internal plane in plaintext."""

    def __init__(
        self,
        name: str,
        model: Path,
        served: str,
        kv_store: str | None,
        cache: bool,
        decode_blocks: int | None = None,
    ):
        self.name, self.model, self.served = name, model, served
        self.kv_store, self.prefix_cache = kv_store, cache
        self.decode_blocks = decode_blocks
        self.gateway: GatewayServer | None = None
        self.decode: DecodeInstance | None = None
        self.instances: list[Any] = []

    async def start(self) -> None:
        gateway = GatewayServer(
            GatewayConfig(
                host="127.0.0.1",
                port=0,
                grpc_port=0,
                internal_port=0,
                insecure=True,
                heartbeat_interval_s=0.2,
                preempt_retry_count=64,
            )
        )
        await gateway.start()
        common: dict[str, Any] = {
            "model": str(self.model), "served_model_name": self.served, "port": 0,
            "gateway": f"127.0.0.1:{gateway.internal_port}", "insecure": True,
            "num_threads": 1, "kv_store": self.kv_store,
        }  # fmt: skip
        prefill = await create_prefill(PrefillConfig(**common, prefix_cache=self.prefix_cache))
        pool = {} if self.decode_blocks is None else {"num_blocks": self.decode_blocks,
                                                       "reserve_tokens": 0}  # fmt: skip
        self.decode = await create_decode(DecodeConfig(**common, **pool))
        self.gateway, self.instances = gateway, [prefill, self.decode]
        for instance in self.instances:
            await asyncio.wait_for(instance.registration.is_registered.wait(), 60)
        while not gateway.frontend.list_models():
            await asyncio.sleep(0.05)

    def client(self) -> openai.AsyncOpenAI:
        assert self.gateway is not None
        url = f"http://127.0.0.1:{self.gateway.http_port}/v1"
        return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)

    async def stall(self, prompt: list[int]) -> tuple[float, list[int]]:
        """Streams `prompt`, preempts after PREEMPT_AFTER tokens; the stall and the tokens."""
        assert self.decode is not None
        ids: list[int] = []
        arrivals: list[float] = []  # NOTE: times of the token chunks after the preemption
        chunks = await self.client().completions.create(
            model=self.served, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        async for chunk in chunks:
            now = time.perf_counter()
            got = [t for c in chunk.choices for t in c.model_extra["token_ids"]]
            if not got:
                continue
            ids.extend(got)
            if arrivals:
                arrivals.append(now)
            elif len(ids) >= PREEMPT_AFTER:
                arrivals.append(now)
                self.decode.loop.preempt_all(PreemptionReason.OUT_OF_BLOCKS)
        # NOTE: tokens already on their way still arrive after the preemption is asked for;
        # the stall is the longest gap between token chunks from then on.
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        assert gaps, "no token came after the preemption"
        return max(gaps), ids

    async def complete(self, prompt: list[int], max_tokens: int) -> list[int]:
        """A streamed greedy completion's token ids (no preemption asked for)."""
        ids: list[int] = []
        chunks = await self.client().completions.create(
            model=self.served, prompt=prompt, max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        async for chunk in chunks:
            ids.extend(t for c in chunk.choices for t in c.model_extra["token_ids"])
        return ids

    def prefill_tokens(self) -> int:
        """Prompt tokens the prefill computed so far (loaded or cached ones not counted)."""
        return int(self.instances[0].loop.num_prompt_tokens)

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.stop(0.5)
        for instance in self.instances:
            await instance.stop(grace=None)


async def storm(args: argparse.Namespace, resolved: Any, store_dir: Path) -> dict[str, Any]:
    """Many streams on a decode pool too small for them: prefill tokens, store vs not."""
    setups = [
        Setup("recompute", resolved.path, resolved.name, None, False, args.storm_blocks),
        Setup(
            "store",
            resolved.path,
            resolved.name,
            f"file:{store_dir}/storm",
            False,
            args.storm_blocks,
        ),
    ]
    reference = Setup("reference", resolved.path, resolved.name, None, cache=False)
    rng = random.Random(1)
    prompts = [[rng.randrange(1000, 20000) for _ in range(32)] for _ in range(args.storm_streams)]
    await reference.start()
    try:
        expected = [await reference.complete(p, args.storm_tokens) for p in prompts]
    finally:
        await reference.stop()
    row: dict[str, Any] = {"streams": len(prompts), "decode_blocks": args.storm_blocks}
    for setup in setups:
        await setup.start()
        try:
            before = setup.prefill_tokens()
            outputs = await asyncio.gather(*(setup.complete(p, args.storm_tokens) for p in prompts))
            assert setup.decode is not None
            row[f"{setup.name}_prefill_tokens"] = setup.prefill_tokens() - before
            row[f"{setup.name}_preemptions"] = setup.decode.loop.num_preemptions
            row[f"{setup.name}_outputs_equal"] = outputs == expected
        finally:
            await setup.stop()
    row["store_over_recompute"] = round(
        row["store_prefill_tokens"] / max(1, row["recompute_prefill_tokens"]), 3
    )
    print(
        f"storm: {row['streams']} streams, {args.storm_blocks} decode blocks: prefill computed "
        f"{row['recompute_prefill_tokens']} tokens ({row['recompute_preemptions']} preemptions) "
        f"without the store, {row['store_prefill_tokens']} ({row['store_preemptions']}) with it "
        f"({row['store_over_recompute']:.2f}x); outputs equal the reference: "
        f"{row['recompute_outputs_equal']} / {row['store_outputs_equal']}",
        flush=True,
    )
    return row


async def run(args: argparse.Namespace) -> dict[str, Any]:
    resolved = resolve_model(args.model, show_progress=True)
    store_dir = Path(tempfile.mkdtemp(prefix="bench-kv-resume-"))
    if args.storm_only:
        return {"command": " ".join(sys.argv[1:]), "storm": await storm(args, resolved, store_dir)}
    setups = [
        Setup("recompute", resolved.path, resolved.name, None, cache=False),
        Setup("store", resolved.path, resolved.name, f"file:{store_dir}", cache=False),
        Setup("prefix_cache", resolved.path, resolved.name, None, cache=True),
    ]
    for setup in setups:
        await setup.start()
    rng = random.Random(0)
    rows = []
    try:
        # NOTE: warm every path once (first passes, store files, connections).
        for setup in setups:
            await setup.stall([rng.randrange(1000, 20000) for _ in range(64)])
        for context in args.contexts:
            stalls: dict[str, list[float]] = {s.name: [] for s in setups}
            for repeat in range(args.repeats):
                prompt = [rng.randrange(1000, 20000) for _ in range(context)]
                outputs = {}
                order = setups if repeat % 2 == 0 else setups[::-1]
                for setup in order:
                    seconds, outputs[setup.name] = await setup.stall(prompt)
                    stalls[setup.name].append(seconds)
                if len({tuple(ids) for ids in outputs.values()}) != 1:
                    raise AssertionError(f"outputs differ across setups at context {context}")
            row: dict[str, Any] = {"context_tokens": context}
            for name, values in stalls.items():
                row[f"{name}_stall_ms"] = round(1000 * statistics.median(values), 1)
            row["store_over_recompute"] = round(
                row["store_stall_ms"] / row["recompute_stall_ms"], 3
            )
            row["prefix_cache_over_recompute"] = round(
                row["prefix_cache_stall_ms"] / row["recompute_stall_ms"], 3
            )
            rows.append(row)
            print(
                f"{context:>6} tokens  stall: recompute {row['recompute_stall_ms']:>7.1f} ms  "
                f"store {row['store_stall_ms']:>7.1f} ms ({row['store_over_recompute']:.2f}x)  "
                f"prefix cache {row['prefix_cache_stall_ms']:>7.1f} ms "
                f"({row['prefix_cache_over_recompute']:.2f}x)",
                flush=True,
            )
    finally:
        for setup in setups:
            await setup.stop()
    return {"command": " ".join(sys.argv[1:]), "model": resolved.name, "rows": rows,
            "max_tokens": MAX_TOKENS, "preempt_after": PREEMPT_AFTER,
            "storm": await storm(args, resolved, store_dir)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--storm-streams", type=int, default=16)
    parser.add_argument("--storm-blocks", type=int, default=48, help="the storm's decode pool")
    parser.add_argument("--storm-tokens", type=int, default=96)
    parser.add_argument("--storm-only", action="store_true", help="run only the storm")
    results = asyncio.run(run(parser.parse_args()))
    print(f"results: {write_results('kv_resume', results)}")


if __name__ == "__main__":
    main()
