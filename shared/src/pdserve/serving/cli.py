"""The command line of a prefill or decode instance: flags, logging, tracing, then serve."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import structlog

from pdserve.common.config import add_arguments, from_args
from pdserve.common.grpc_server import ListenError
from pdserve.common.logging import configure_logging, exit_served_process
from pdserve.common.security import Security
from pdserve.common.telemetry import configure_tracing, shutdown_tracing
from pdserve.engine.model_config import ModelLoadError
from pdserve.serving.config import InstanceConfig

ConfigT = TypeVar("ConfigT", bound=InstanceConfig)


def build_parser(
    prog: str, description: str, config_type: type[InstanceConfig]
) -> argparse.ArgumentParser:
    """A parser with one flag per field of `config_type` (the fields' help is ``--help``).

    Args:
        prog: The command, ``pdserve-<role>``.
        description: What the instance does, for ``--help``.
        config_type: The role's config dataclass.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser, config_type)
    return parser


def run(
    parser: argparse.ArgumentParser,
    config_type: type[ConfigT],
    serve: Callable[[ConfigT], Coroutine[Any, Any, None]],
    argv: list[str] | None = None,
) -> int:
    """Parses `argv`, configures logging and tracing, and runs `serve` until it returns; then
    the process exits with status 0 (`exit_served_process`).

    Returns:
        2 for settings the config refuses, unusable certificates or a model the engine refuses,
        1 for a port it cannot listen on (the reason goes to stderr); a served run does not
        return.
    """
    args = parser.parse_args(argv)
    try:
        config = from_args(config_type, args)
        if not config.insecure:
            # NOTE: read the certificates once here, so a bad file is a usage error.
            Security.from_flags(config, parser.prog.removeprefix("pdserve-"))
    except ValueError as error:
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2
    configure_logging(parser.prog.removeprefix("pdserve-"), config.log_level)
    configure_tracing(parser.prog, config.otlp_endpoint, config.trace_sample_ratio)
    try:
        asyncio.run(serve(config))
    except ModelLoadError as error:
        # NOTE: refused before the instance starts its servers, so it never registers.
        structlog.get_logger(__name__).error("model_refused", model=config.model, reason=str(error))
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 2
    except ListenError as error:
        structlog.get_logger(__name__).error("listen_failed", reason=str(error))
        print(f"{parser.prog}: {error}", file=sys.stderr)
        return 1
    finally:
        shutdown_tracing()
    exit_served_process(0)
