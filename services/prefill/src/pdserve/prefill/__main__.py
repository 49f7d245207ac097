"""`pdserve-prefill`: run a prefill instance."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pdserve.common.config import add_arguments, from_args
from pdserve.common.logging import configure_logging
from pdserve.common.telemetry import configure_tracing, shutdown_tracing
from pdserve.prefill.config import PrefillConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve-prefill",
        description=(
            "pdserve prefill instance: runs prompts for the decode instance a gateway picks. "
            "Each request first leases blocks on its decode (AllocateBlocks; a slow decode "
            "only delays its own requests), then joins a prefill-only scheduler (FCFS, a "
            "token budget per forward pass, long prompts chunked across passes). KV is "
            "pushed to the decode over SyncCache layer by layer while later layers compute; "
            "the first token is streamed at once, HandedOff follows the decode's commit. "
            "Serves pdserve.v1.PrefillService, InstanceService, gRPC health and reflection."
        ),
    )
    add_arguments(parser, PrefillConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = from_args(PrefillConfig, args)
    except ValueError as error:
        print(f"pdserve-prefill: {error}", file=sys.stderr)
        return 2
    configure_logging("prefill", config.log_level)
    configure_tracing("pdserve-prefill", config.otlp_endpoint, config.trace_sample_ratio)
    try:
        asyncio.run(serve_main(config))
    finally:
        shutdown_tracing()
    return 0


async def serve_main(config: PrefillConfig) -> None:
    from pdserve.prefill.server import serve

    await serve(config)


if __name__ == "__main__":
    raise SystemExit(main())
