"""`pdserve-decode`: run a decode instance."""

from __future__ import annotations

import argparse
import asyncio
import sys

from pdserve.common.config import add_arguments, from_args
from pdserve.common.logging import configure_logging
from pdserve.common.telemetry import configure_tracing, shutdown_tracing
from pdserve.decode.config import DecodeConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve-decode",
        description=(
            "pdserve decode instance: leases KV blocks to prefill instances, receives their KV "
            "over SyncCache, decodes with continuous batching and streams tokens to the "
            "gateway. Serves pdserve.v1.DecodeService, InstanceService, gRPC health and "
            "reflection."
        ),
    )
    add_arguments(parser, DecodeConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = from_args(DecodeConfig, args)
    except ValueError as error:
        print(f"pdserve-decode: {error}", file=sys.stderr)
        return 2
    configure_logging("decode", config.log_level)
    configure_tracing("pdserve-decode", config.otlp_endpoint, config.trace_sample_ratio)
    try:
        asyncio.run(serve_main(config))
    finally:
        shutdown_tracing()
    return 0


async def serve_main(config: DecodeConfig) -> None:
    from pdserve.decode.server import serve

    await serve(config)


if __name__ == "__main__":
    raise SystemExit(main())
