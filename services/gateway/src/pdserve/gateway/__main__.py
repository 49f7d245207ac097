"""``pdserve-gateway``: the OpenAI-compatible front door of a pdserve cluster."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

import structlog

from pdserve.common import env
from pdserve.common.config import add_arguments, from_args
from pdserve.common.grpc_server import ListenError
from pdserve.common.logging import configure_logging, exit_served_process
from pdserve.common.security import Security
from pdserve.common.supervisor import watch_supervisor
from pdserve.common.telemetry import configure_tracing, shutdown_tracing
from pdserve.gateway.access.api_keys import ApiKeyStore
from pdserve.gateway.config import GatewayConfig
from pdserve.gateway.server import create_server

DESCRIPTION = """\
Serves the OpenAI-compatible REST API (GET /v1/models, POST /v1/completions,
POST /v1/chat/completions with SSE streaming, GET /health, GET /metrics) and the public gRPC
GenerationService, and runs the registry that prefill and decode instances join over
RegistryService (on the internal port), or, with --registry etcd://HOST:PORT, watches the
registry in etcd that several gateways share. Each request is prefilled on one instance and
decoded on another; capacity refusals, lost instances and preemptions are retried or
rescheduled so the client sees one seamless stream, or a typed OpenAI-style error.
"""

EPILOG = """\
examples:
  # instances register themselves at this gateway's internal port (50051)
  pdserve-gateway --port 8000 --grpc-port 50050
  # or name them statically; they are polled for health and load
  pdserve-gateway --prefill 10.0.0.5:50061 --decode 10.0.0.6:50071 --decode 10.0.0.7:50071
  # or share the instances registered in etcd with other gateways (instances: --registry too)
  pdserve-gateway --registry etcd://10.0.0.2:2379
  # read tool calls as Llama 3 writes them, whatever the model's chat template says
  pdserve-gateway --tool-call-parser llama3_json
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "demo", "prompt": "Hello", "max_tokens": 16}'
"""


async def serve(config: GatewayConfig) -> None:
    """Runs a gateway until SIGTERM or SIGINT (or its supervisor's exit,
    `pdserve.common.supervisor`), then drains and stops it."""
    server = create_server(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    unwatch = watch_supervisor(loop, stop.set)
    try:
        await stop.wait()
    finally:
        unwatch()
        await server.stop()


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser; every flag is a `GatewayConfig` field."""
    parser = argparse.ArgumentParser(
        prog="pdserve-gateway",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser, GatewayConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parses flags, configures logging and serves until SIGTERM/SIGINT; then the process exits
    with status 0 (`exit_served_process`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = from_args(GatewayConfig, args)
        # NOTE: read once here too, so a bad key file or $PDSERVE_API_KEYS is a usage error.
        ApiKeyStore.from_settings(config.api_key, config.api_key_file, env.api_keys())
        if not config.insecure:
            Security.from_flags(config, "gateway")  # a bad certificate is a usage error too
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging("gateway", config.log_level, json=config.log_format == "json")
    configure_tracing("pdserve-gateway", config.otlp_endpoint, config.trace_sample_ratio)
    try:
        asyncio.run(serve(config))
    except ListenError as error:
        structlog.get_logger(__name__).error("listen_failed", reason=str(error))
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 1
    finally:
        shutdown_tracing()
    exit_served_process(0)


if __name__ == "__main__":
    sys.exit(main())
