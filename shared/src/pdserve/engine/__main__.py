"""Command line: generate from a model (SmolLM2-135M-Instruct by default).

python -m pdserve.engine --prompt "Hello" --max-tokens 32
python -m pdserve.engine --model DIR --chat --prompt "Who are you?" --temperature 0.8 --seed 1
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from pdserve.common.generation import SamplingParams
from pdserve.common.logging import LEVELS, configure_logging
from pdserve.engine.colocated import LLMEngine
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.model_store import DEFAULT_MODEL, MODEL_HELP, resolve_model
from pdserve.engine.precision import AUTO, QUANTIZATIONS


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments; defaults come from the config dataclasses."""
    sampling, cache, scheduler = SamplingParams(), CacheConfig(), SchedulerConfig()
    parser = argparse.ArgumentParser(prog="python -m pdserve.engine", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    parser.add_argument(
        "--prompt-token-ids", action="append", default=[], help="comma-separated ids (repeatable)"
    )
    parser.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    parser.add_argument("--max-tokens", type=int, default=sampling.max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=sampling.top_k)
    parser.add_argument("--top-p", type=float, default=sampling.top_p)
    parser.add_argument("--seed", type=int, default=sampling.seed)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--dtype",
        default=AUTO,
        help="auto (bfloat16 on a CPU with native bf16, else float32), float32, bfloat16 or "
        "float16",
    )
    parser.add_argument(
        "--quantization",
        default=AUTO,
        choices=QUANTIZATIONS,
        help="auto keeps a GGUF's Q4_0/Q4_1/Q4_K weights as int4 (bfloat16 on CPU) and MXFP4 "
        "experts as int8; none dequantizes every weight; int8 / int4 quantize the float "
        "projections (CPU)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="capture no decode graphs (CUDA)"
    )
    parser.add_argument("--num-threads", type=int, help="torch intra-op threads")
    parser.add_argument("--log-level", default="warning", choices=LEVELS, help="logs go to stderr")
    parser.add_argument("--block-size", type=int, default=cache.block_size)
    parser.add_argument("--num-blocks", type=int, default=cache.num_blocks)
    parser.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=cache.memory_bytes,
        help="KV cache budget; sized from free memory when unset (and --num-blocks too)",
    )
    parser.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=cache.memory_fraction,
        help="share of free memory an automatic KV cache size takes (0.1 of RAM on CPU, 0.9 "
        "of free GPU memory when unset)",
    )
    parser.add_argument(
        "--release-window-blocks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="sliding-window layers (Gemma 3, gpt-oss, Mistral) keep only their window: their "
        "KV of a block is let go once every sequence is a window past it, and the memory goes "
        "to more blocks of the full-attention layers (one rank, no decode graphs)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=scheduler.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=scheduler.max_num_batched_tokens
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the process exit code."""
    args = build_parser().parse_args(argv)
    configure_logging("engine", args.log_level, json=False)
    try:
        model_dir = resolve_model(args.model, show_progress=True).path
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    tokenizer = None
    if (model_dir / "tokenizer.json").is_file():
        from pdserve.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_pretrained(model_dir)
    prompts: list[list[int]] = [[int(t) for t in ids.split(",")] for ids in args.prompt_token_ids]
    if args.prompt and tokenizer is None:
        print(f"error: {model_dir} has no tokenizer.json; use --prompt-token-ids", file=sys.stderr)
        return 2
    for text in args.prompt:
        assert tokenizer is not None
        if args.chat:
            prompts.append(tokenizer.encode_chat([{"role": "user", "content": text}]))
        else:
            prompts.append(tokenizer.encode(text))
    if not prompts:
        prompts.append(tokenizer.encode("Hello") if tokenizer else [1])
    try:
        config = EngineConfig(
            model=str(model_dir),
            dtype=args.dtype,
            quantization=args.quantization,
            device=args.device,
            num_threads=args.num_threads,
            enforce_eager=args.enforce_eager,
            cache=CacheConfig(
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                memory_bytes=args.kv_cache_memory_bytes,
                memory_fraction=args.kv_cache_memory_fraction,
                release_window_blocks=args.release_window_blocks,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
            ),
        )
        params = SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = LLMEngine(config)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, output in zip(prompts, outputs, strict=True):
        text = tokenizer.decode(output) if tokenizer else " ".join(map(str, output))
        print(f"--- prompt ({len(prompt)} tokens), {len(output)} new tokens")
        print(text)
    num_tokens = sum(len(o) for o in outputs)
    print(f"--- {num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
