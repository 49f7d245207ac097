"""Does a request give the same tokens whatever the load? Counted on a real cluster.

    python bench/batch_invariance.py                          # bfloat16, with and without
    python bench/batch_invariance.py --modes deterministic --prompts 20 --max-tokens 200

For each mode (``fast``: the default engine; ``deterministic``: ``--deterministic`` on the
prefill and both decodes), a gateway + 1 prefill + 2 decodes (the launcher) serves the default
model in ``--dtype``; ``--prompts`` greedy chat-free completions of ``--max-tokens`` tokens
(``ignore_eos``) are run

* alone, one after the other (the reference);
* each beside 7 other requests running at the same time;
* all at once, with the decode serving the most of them SIGKILLed after ``--kill-after``
  tokens of each (the gateway moves the streams to the other decode, which recomputes them).

Prints, per mode, how many of the prompts came out equal to the reference in each case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import time
from typing import Any

import httpx
from common import cpu_description, write_results
from serve import smollm2_model_dir

from pdserve.launcher.cluster import Cluster
from pdserve.launcher.config import ClusterConfig

TOPICS = (
    "rivers", "bridges", "volcanoes", "libraries", "trains", "bees", "glaciers", "markets",
    "telescopes", "forests", "harbors", "deserts", "orchestras", "castles", "comets", "gardens",
    "lighthouses", "caves", "windmills", "islands", "canals", "clocks", "storms", "museums",
)  # fmt: skip


async def complete(http: httpx.AsyncClient, url: str, model: str, prompt: str, n: int) -> Any:
    """One streamed greedy completion's token ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    ids: list[int] = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    ids.extend(choice.get("token_ids") or ())
    return ids


async def measure(
    cluster: Cluster, prompts: list[str], others: list[str], n: int, kill_after: int
) -> dict[str, int]:
    url = cluster.rest_url
    async with httpx.AsyncClient(timeout=600) as http:
        model = (await http.get(f"{url}/v1/models")).json()["data"][0]["id"]
        alone = [await complete(http, url, model, p, n) for p in prompts]
        beside = 0
        for index, prompt in enumerate(prompts):
            extra = [others[(index + j) % len(others)] for j in range(7)]
            got = await asyncio.gather(
                *(complete(http, url, model, p, n) for p in [prompt, *extra])
            )
            beside += got[0] == alone[index]
        tasks = [asyncio.create_task(complete(http, url, model, p, n)) for p in prompts]
        # NOTE: wait until every stream has produced about kill_after tokens (by time: a
        # lower bound from the step rate measured alone would be more exact; this is a bench).
        started = time.monotonic()
        while time.monotonic() - started < 60:
            await asyncio.sleep(0.5)
            committed = sum(
                1 for c in cluster.children if c.name.startswith("decode")
                for e in list(c.events) if e.get("event") == "lease_committed"
            )  # fmt: skip
            if committed >= 3 * len(prompts):
                break
        await asyncio.sleep(kill_after * 0.05)
        decodes = [c for c in cluster.children if c.name.startswith("decode")]
        victim = max(
            decodes, key=lambda c: sum(e.get("event") == "lease_committed" for e in list(c.events))
        )
        victim.signal(signal.SIGKILL)
        moved = await asyncio.gather(*tasks)
        after_kill = sum(got == want for got, want in zip(moved, alone, strict=True))
    return {"alone": len(prompts), "beside_7_others": beside, "decode_sigkilled": after_kill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["fast", "deterministic"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=150)
    parser.add_argument("--kill-after", type=int, default=30)
    args = parser.parse_args()
    cpu = cpu_description()
    print(f"CPU: {cpu['cpu']}, flags: {' '.join(cpu['flags'])}")
    prompts = [
        f"Write a few sentences about {TOPICS[i % len(TOPICS)]}." for i in range(args.prompts)
    ]
    others = [f"Tell me everything about {topic} and their history." for topic in TOPICS[:8]]
    rows = []
    for mode in args.modes:
        flags = f"--dtype {args.dtype} --num-blocks 2048" + (
            " --deterministic" if mode == "deterministic" else ""
        )
        config = ClusterConfig(
            model=str(smollm2_model_dir()),
            port=0,
            grpc_port=0,
            internal_port=0,
            decodes=2,
            log_dir=tempfile.mkdtemp(prefix=f"bench-invariance-{mode}-"),
            prefill_args=flags,
            decode_args=flags,
        )
        cluster = Cluster(config)
        cluster.start()
        try:
            counts = asyncio.run(
                measure(cluster, prompts, others, args.max_tokens, args.kill_after)
            )
        finally:
            cluster.stop(timeout_s=20)
        rows.append({"mode": mode, **counts})
        print(f"{mode}: {counts}", flush=True)
    print(f"\n{args.prompts} greedy prompts, {args.max_tokens} tokens, {args.dtype}\n")
    print("| mode | beside 7 others equal | decode SIGKILLed mid-stream equal |")
    print("|---|---|---|")
    for row in rows:
        total = row["alone"]
        print(
            f"| {row['mode']} | {row['beside_7_others']}/{total} | "
            f"{row['decode_sigkilled']}/{total} |"
        )
    path = write_results("batch_invariance", {"settings": {**vars(args), **cpu}, "rows": rows})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
