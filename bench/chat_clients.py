"""Concurrent chat users against a running endpoint, with the openai SDK: does it serve them all?

Each of ``--clients`` users sends ``--requests-per-client`` streaming chat requests one after
the other: a prompt of about ``--prompt-words`` random words (about as many tokens for
SmolLM2's tokenizer) and ``--max-tokens`` output tokens (``ignore_eos``). With ``--cancel``, that
fraction of the requests is dropped by its client: half after a random 0-2 s (often while the
request still waits for its first token), half after a random number of streamed tokens.
Prints one line: requests finished, cancelled and failed (with the first error messages), the
prompt tokens the server counted, TTFT p50 and max, and the wall time; exits 1 on any error.

    make up                      # another terminal
    .venv/bin/python bench/chat_clients.py --url http://127.0.0.1:8000 --clients 16
    .venv/bin/python bench/chat_clients.py --url http://127.0.0.1:8000 --clients 16 --cancel 0.3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import openai
from loadgen import WORDS


@dataclass
class Tally:
    """What the users saw."""

    num_finished: int = 0
    num_cancelled: int = 0
    errors: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)


async def one_request(
    client: openai.AsyncOpenAI,
    args: argparse.Namespace,
    prompt: str,
    tally: Tally,
    stop_after: int | None,
) -> None:
    """Streams one chat completion; stops reading after `stop_after` chunks (a cancel)."""
    started = time.perf_counter()
    num_chunks = 0
    try:
        stream = await client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=args.max_tokens,
            temperature=0.7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                tally.prompt_tokens.append(chunk.usage.prompt_tokens)
            if chunk.choices and chunk.choices[0].delta.content:
                num_chunks += 1
                if num_chunks == 1:
                    tally.ttft_s.append(time.perf_counter() - started)
                if stop_after is not None and num_chunks >= stop_after:
                    await stream.close()
                    tally.num_cancelled += 1
                    return
        tally.num_finished += 1
    except openai.APIError as error:
        tally.errors.append(repr(error)[:200])


async def user(client: openai.AsyncOpenAI, args: argparse.Namespace, rng: random.Random,
               tally: Tally) -> None:  # fmt: skip
    for _ in range(args.requests_per_client):
        prompt = "Summarize this: " + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        draw = rng.random()
        if draw < args.cancel / 2:
            task = asyncio.ensure_future(one_request(client, args, prompt, tally, None))
            await asyncio.sleep(rng.uniform(0, 2))
            if not task.done():
                task.cancel()
                tally.num_cancelled += 1
                await asyncio.gather(task, return_exceptions=True)
            continue
        stop_after = rng.randint(1, args.max_tokens - 1) if draw < args.cancel else None
        await one_request(client, args, prompt, tally, stop_after)


async def main(args: argparse.Namespace) -> int:
    client = openai.AsyncOpenAI(
        base_url=f"{args.url}/v1", api_key=args.api_key, max_retries=0, timeout=args.timeout_s
    )
    tally = Tally()
    rng = random.Random(args.seed)
    started = time.perf_counter()
    await asyncio.gather(*(user(client, args, rng, tally) for _ in range(args.clients)))
    wall_s = time.perf_counter() - started
    ttft = sorted(tally.ttft_s)
    prompt_tokens = statistics.fmean(tally.prompt_tokens or [0])
    print(
        f"clients={args.clients} finished={tally.num_finished} cancelled={tally.num_cancelled} "
        f"errors={len(tally.errors)} prompt_tokens~{prompt_tokens:.0f}"
        f" ttft_p50={statistics.median(ttft or [0]):.2f}s ttft_max={max(ttft or [0]):.2f}s "
        f"wall={wall_s:.1f}s"
    )
    for error in tally.errors[:5]:
        print("  error:", error)
    return 1 if tally.errors else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (no /v1)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--clients", type=int, default=16, help="concurrent users")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=280, help="~ prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--cancel", type=float, default=0.0, help="fraction cancelled")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser


if __name__ == "__main__":
    sys.exit(asyncio.run(main(build_parser().parse_args())))
