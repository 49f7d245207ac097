"""`pdserve-decode`: run a decode instance."""

from __future__ import annotations

import argparse

from pdserve.decode.config import DecodeConfig
from pdserve.serving import cli

DESCRIPTION = (
    "pdserve decode instance: leases KV blocks to prefill instances, receives their KV "
    "over SyncCache, decodes with continuous batching and streams tokens to the "
    "gateway. Serves pdserve.v1.DecodeService, InstanceService, gRPC health and "
    "reflection."
)


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser("pdserve-decode", DESCRIPTION, DecodeConfig)


def main(argv: list[str] | None = None) -> int:
    return cli.run(build_parser(), DecodeConfig, serve_main, argv)


async def serve_main(config: DecodeConfig) -> None:
    # NOTE: imported here so that --help and refused flags answer without loading torch.
    from pdserve.decode.server import serve

    await serve(config)


if __name__ == "__main__":
    raise SystemExit(main())
