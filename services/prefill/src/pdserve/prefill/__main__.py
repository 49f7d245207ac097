"""`pdserve-prefill`: run a prefill instance."""

from __future__ import annotations

import argparse

import structlog

from pdserve.common.memory import bound_onednn_cache
from pdserve.prefill.config import PrefillConfig
from pdserve.serving import cli

# NOTE: a prefill's GEMM shapes follow its prompts' lengths: oneDNN's default cache (1,024
# primitives) held about 350 MB of them after a few thousand requests; 64 keeps the reuse
# within a forward pass (every layer's GEMMs share their shapes) and the last prompts' shapes,
# at no cost measured to the time to first token (`pdserve.common.memory.bound_onednn_cache`).
ONEDNN_CACHE_CAPACITY = 64

DESCRIPTION = (
    "pdserve prefill instance: runs prompts for the decode instance a gateway picks. "
    "Each request first leases blocks on its decode (AllocateBlocks; a slow decode "
    "only delays its own requests), then joins a prefill-only scheduler (FCFS, a "
    "token budget per forward pass, long prompts chunked across passes). KV is "
    "pushed to the decode over SyncCache layer by layer while later layers compute; "
    "the first token is streamed at once, HandedOff follows the decode's commit. "
    "Serves pdserve.v1.PrefillService, InstanceService, gRPC health and reflection."
)


def build_parser() -> argparse.ArgumentParser:
    return cli.build_parser("pdserve-prefill", DESCRIPTION, PrefillConfig)


def main(argv: list[str] | None = None) -> int:
    return cli.run(build_parser(), PrefillConfig, serve_main, argv)


async def serve_main(config: PrefillConfig) -> None:
    capacity = bound_onednn_cache(ONEDNN_CACHE_CAPACITY)
    structlog.get_logger(__name__).info("onednn_cache_bounded", capacity=capacity)
    # NOTE: imported here so that --help and refused flags answer without loading torch.
    from pdserve.prefill.server import serve

    await serve(config)


if __name__ == "__main__":
    raise SystemExit(main())
