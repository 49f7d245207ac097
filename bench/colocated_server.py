"""The colocated engine behind an OpenAI-compatible REST API: the baseline of bench/serve.py.

One process: `LLMEngine` (prefill and decode in the same continuous batch) steps on its own
thread; a FastAPI app serves ``POST /v1/completions`` (streamed as server-sent events or as
one body), ``GET /v1/models`` and ``GET /health`` with the semantics the load generator
relies on, the same as pdserve's gateway: text or token-id prompts, ``max_tokens``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``ignore_eos``, ``stream_options.
include_usage`` and ``return_token_ids``. Text is detokenized incrementally per chunk, as
the gateway does.

    .venv/bin/python bench/colocated_server.py [--model DIR] [--port 0] [--num-threads N]

Once serving it prints one JSON line on stdout: ``{"event": "colocated_started", "port": P,
"model": NAME}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from pdserve.common.generation import FinishReason, SamplingParams
from pdserve.common.logging import configure_logging
from pdserve.engine.colocated import LLMEngine
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.tokenizer import TextStream, Tokenizer


class StreamOptions(BaseModel):
    """``stream_options`` of the OpenAI API."""

    include_usage: bool = False


class CompletionBody(BaseModel):
    """The part of the OpenAI completions request this server understands."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | list[int]
    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False


@dataclass
class Job:
    """One request in flight: the engine thread feeds its queue, the handler drains it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[tuple[list[int], str | None]] = field(default_factory=asyncio.Queue)


class EngineThread:
    """Runs `LLMEngine.step()` on a thread of its own, never on the event loop.

    Args:
        engine: The engine (used only from this thread once started).
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._jobs: dict[str, Job] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queues a request; its tokens arrive on ``job.outputs``."""
        self._commands.put(("add", job))

    def abort(self, request_id: str) -> None:
        """Drops a request (its client went away)."""
        self._commands.put(("abort", request_id))

    def _apply(self, command: str, arg: Any) -> None:
        if command == "add":
            job: Job = arg
            try:
                self.engine.add_request(job.request_id, job.prompt_token_ids, job.sampling)
            except ValueError as error:
                job.loop.call_soon_threadsafe(job.outputs.put_nowait, ([], f"error: {error}"))
                return
            self._jobs[job.request_id] = job
        elif command == "abort" and self._jobs.pop(arg, None) is not None:
            self.engine.abort_request(arg)

    def _run(self) -> None:
        while True:
            # NOTE: block only while idle; while requests run, take commands between steps.
            block = not self.engine.has_unfinished_requests()
            try:
                command, arg = self._commands.get(block=block)
                self._apply(command, arg)
                while True:
                    command, arg = self._commands.get_nowait()
                    self._apply(command, arg)
            except queue.Empty:
                pass
            for output in self.engine.step():
                job = self._jobs.get(output.request_id)
                if job is None:
                    continue
                reason = None
                if output.finished:
                    self._jobs.pop(output.request_id, None)
                    reason = _finish_reason(output.finish_reason)
                if output.new_token_ids or reason is not None:
                    item = (list(output.new_token_ids), reason)
                    job.loop.call_soon_threadsafe(job.outputs.put_nowait, item)


def _finish_reason(reason: FinishReason | None) -> str:
    return "length" if reason is FinishReason.LENGTH else "stop"


def _sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def create_app(engine_thread: EngineThread, tokenizer: Tokenizer, model_name: str) -> FastAPI:
    """The REST app in front of a running `EngineThread`."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, http: Request) -> Any:
        if body.model != model_name:
            message = f"the model {body.model!r} does not exist"
            return JSONResponse({"error": {"message": message, "code": "not_found"}}, 404)
        if isinstance(body.prompt, str):
            prompt_ids = tokenizer.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
        try:
            sampling = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=max(0, body.top_k or 0),
                seed=body.seed,
                max_tokens=body.max_tokens,
                ignore_eos=body.ignore_eos,
            )
        except ValueError as error:
            return JSONResponse({"error": {"message": str(error), "code": "invalid"}}, 400)
        job = Job(uuid.uuid4().hex, prompt_ids, sampling, asyncio.get_running_loop())
        engine_thread.submit(job)
        envelope = {
            "id": f"cmpl-{job.request_id}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = _stream(job, tokenizer, envelope, body.return_token_ids, include_usage)
            return StreamingResponse(
                _abort_on_exit(events, engine_thread, job), media_type="text/event-stream"
            )
        text, token_ids, reason = "", [], None
        stream = TextStream(tokenizer, context_token_ids=prompt_ids)
        try:
            while reason is None:
                new_ids, reason = await job.outputs.get()
                token_ids.extend(new_ids)
                text += stream.add_tokens(new_ids).text
        finally:
            if reason is None:
                engine_thread.abort(job.request_id)
        text += stream.finish().text
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": reason}
        if body.return_token_ids:
            choice["token_ids"] = token_ids
        return {**envelope, "choices": [choice], "usage": _usage(len(prompt_ids), token_ids)}

    return app


def _usage(num_prompt_tokens: int, token_ids: list[int]) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": len(token_ids),
        "total_tokens": num_prompt_tokens + len(token_ids),
    }


async def _stream(
    job: Job,
    tokenizer: Tokenizer,
    envelope: dict[str, Any],
    return_token_ids: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    stream = TextStream(tokenizer, context_token_ids=job.prompt_token_ids)
    token_ids: list[int] = []
    reason: str | None = None
    while reason is None:
        new_ids, reason = await job.outputs.get()
        if reason is not None and reason.startswith("error: "):
            yield _sse({"error": {"message": reason[7:], "code": "invalid_request"}})
            break
        token_ids.extend(new_ids)
        text = stream.add_tokens(new_ids).text
        if reason is not None:
            text += stream.finish().text
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": reason}
        if return_token_ids:
            choice["token_ids"] = new_ids
        yield _sse({**envelope, "choices": [choice]})
    if include_usage and reason is not None and not reason.startswith("error: "):
        usage = _usage(len(job.prompt_token_ids), token_ids)
        yield _sse({**envelope, "choices": [], "usage": usage})
    yield _sse("[DONE]")


async def _abort_on_exit(
    events: AsyncIterator[str], engine_thread: EngineThread, job: Job
) -> AsyncIterator[str]:
    """Relays `events`; if the client leaves early, the engine drops the request."""
    is_done = False
    try:
        async for event in events:
            yield event
        is_done = True
    finally:
        if not is_done:
            engine_thread.abort(job.request_id)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory; the built-in demo model when unset")
    parser.add_argument("--served-model-name", help="model name; the directory name when unset")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda")
    parser.add_argument("--dtype", default="float32", help="weights and KV dtype")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    configure_logging("colocated", "warning")
    if args.model is None:
        from pdserve.engine.demo import ensure_demo_model

        args.model = str(ensure_demo_model())
    model_name = args.served_model_name or Path(args.model).name
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
            ),
            num_threads=args.num_threads,
        )
    )
    engine_thread = EngineThread(engine)
    engine_thread.start()
    app = create_app(engine_thread, Tokenizer.from_pretrained(args.model), model_name)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(1024)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    )
    started = {"event": "colocated_started", "port": sock.getsockname()[1], "model": model_name}
    print(json.dumps(started), flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
