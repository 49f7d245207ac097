"""Starts gateways, N prefills and M decodes as processes, waits until they are ready, and
stops them in order (backends drain first, then the gateways).

One gateway embeds the registry the instances register with. Several (``--gateways N``) need
the shared registry in etcd (``--registry etcd://HOST:PORT``): every instance registers
there and every gateway watches it; gateway i listens on each of the gateway ports plus i.

`restart` starts a service that exited again with the command line it had: a gateway on the
ports it got at first (clients and the instances it keeps the registry for find it there), a
prefill or decode on a port of its own that it registers again (peers learn it from the
registry). `pdserve.launcher.supervisor` decides when.

Every service (and restart) is forked from the fork server (`pdserve.launcher.forkserver`),
which imported torch and the services' modules once, unless ``--no-fork-server`` or it could
not start: then each is its own ``python -m pdserve.<service>``.

Unless ``--insecure``, the cluster's internal plane is mutual TLS under a throwaway CA made at
start: one certificate per service (and a ``client`` one for operators' tools) in a private
temporary directory that is removed on stop.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import structlog

from pdserve.common.pki import Identity, TlsFiles
from pdserve.engine.model_store import resolve_model
from pdserve.engine.precision import cpu_flags, native_bf16_flags
from pdserve.launcher import certs
from pdserve.launcher.child import ChildProcess
from pdserve.launcher.config import ClusterConfig
from pdserve.launcher.forkserver import PRELOAD, ForkServer, ForkServerError

log = structlog.get_logger(__name__)


def decode_team_args(decodes: int, cores: int, flags: frozenset[str]) -> list[str]:
    """The `--kernel-threads` a started decode gets: on the float32 kernels (a CPU without
    native bf16, where `--dtype auto` is float32) its one-row steps (one user) share their
    GEMMs with every core it has to itself or shares with a prefill idle meanwhile (each step
    1.2-1.5x shorter); steps of more rows keep one thread. On the bf16 kernels none: one thread
    reads its weights near the memory's speed, and a team thread spinning beside the gateway
    and the prefill cost more than it gave (one user's ITL 5.4 against 4.5 ms alone,
    docs/BENCHMARKS.md)."""
    if native_bf16_flags(flags):
        return []
    return ["--kernel-threads", str(max(1, cores // decodes))]


class Cluster:
    """The processes of one cluster.

    Args:
        config: What to start.
        env: Environment for the services (defaults to this process's).
    """

    def __init__(self, config: ClusterConfig, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.env = dict(os.environ if env is None else env)
        self.log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="pdserve-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.gateways: list[ChildProcess] = []
        self.prefills: list[ChildProcess] = []
        self.decodes: list[ChildProcess] = []
        self.http_ports: list[int] = []
        self.grpc_ports: list[int] = []
        self.internal_ports: list[int] = []
        self.tls_dir: Path | None = None
        self.tls: dict[str, TlsFiles] = {}
        self._commands: dict[str, tuple[str, list[str]]] = {}  # name -> (module, args)
        self.fork_server: ForkServer | None = None

    @property
    def gateway(self) -> ChildProcess | None:
        """The first gateway (the only one without ``--gateways``), once started."""
        return self.gateways[0] if self.gateways else None

    @property
    def http_port(self) -> int:
        return self.http_ports[0] if self.http_ports else 0

    @property
    def grpc_port(self) -> int:
        return self.grpc_ports[0] if self.grpc_ports else 0

    @property
    def internal_port(self) -> int:
        return self.internal_ports[0] if self.internal_ports else 0

    @property
    def children(self) -> list[ChildProcess]:
        return [*self.gateways, *self.prefills, *self.decodes]

    @property
    def rest_url(self) -> str:
        return self.rest_urls[0] if self.rest_urls else f"http://{self.config.host}:0"

    @property
    def rest_urls(self) -> list[str]:
        """The REST base URL of every gateway."""
        return [f"http://{self.config.host}:{port}" for port in self.http_ports]

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.grpc_port}"

    @property
    def grpc_addresses(self) -> list[str]:
        """The public gRPC address of every gateway."""
        return [f"{self.config.host}:{port}" for port in self.grpc_ports]

    def _make_certs(self) -> None:
        """The throwaway CA and a certificate per service, named like the processes."""
        if self.config.insecure:
            return
        self.tls_dir = Path(tempfile.mkdtemp(prefix="pdserve-tls-"))
        identities = [Identity("gateway", gateway_name(i)) for i in range(self.config.gateways)]
        identities += [Identity("client", "client")]
        identities += [Identity("prefill", f"prefill-{i}") for i in range(self.config.prefills)]
        identities += [Identity("decode", f"decode-{i}") for i in range(self.config.decodes)]
        self.tls = certs.throwaway(self.tls_dir, identities)

    def _security_args(self, name: str) -> list[str]:
        if self.config.insecure:
            return ["--insecure"]
        files = self.tls[name]
        return [
            "--tls-ca",
            str(files.ca),
            "--tls-cert",
            str(files.cert),
            "--tls-key",
            str(files.key),
        ]

    def _spawn(self, name: str, module: str, args: list[str]) -> ChildProcess:
        is_restart = name in self._commands
        self._commands[name] = (module, args)
        argv = [sys.executable, "-m", module, *args, *self._security_args(name)]
        argv += ["--log-level", self.config.log_level]
        log_path = self.log_dir / f"{name}.log"
        return ChildProcess(
            name, argv, log_path, self.env, is_append=is_restart, fork_server=self.fork_server
        )

    def _start_fork_server(self) -> None:
        """The fork server the services start from (`pdserve.launcher.forkserver`), where the
        configuration asks for it and it starts; else each service starts as its own python."""
        if not self.config.fork_server:
            return
        try:
            self.fork_server = ForkServer(self.log_dir / "fork-server.log", self.env)
        except ForkServerError as error:
            log.warning("fork_server_unavailable", reason=str(error))
            return
        log.info("fork_server_ready", pid=self.fork_server.process.pid, preload=list(PRELOAD))

    def restart(self, child: ChildProcess) -> ChildProcess:
        """Starts the service `child` ran again, with the same flags (a gateway on the ports it
        got at first), in its place; returns the new process without waiting for it to serve.

        Raises:
            ValueError: If `child` is not one of this cluster's current processes.
        """
        for members in (self.gateways, self.prefills, self.decodes):
            if child in members:
                break
        else:
            raise ValueError(f"{child.name} (pid {child.pid}) is not a process of this cluster")
        child.close()
        module, args = self._commands[child.name]
        restarted = self._spawn(child.name, module, args)
        members[members.index(child)] = restarted
        return restarted

    def busy_ports(self, child: ChildProcess) -> list[int]:
        """The ports `child` binds again when restarted (a gateway's; the others take new
        ones) that another socket holds now."""
        if child not in self.gateways:
            return []
        index = self.gateways.index(child)
        ports = (self.http_ports[index], self.grpc_ports[index], self.internal_ports[index])
        return [port for port in ports if port and not _is_free(self.config.host, port)]

    def start(self) -> None:
        """Starts everything and returns once every backend registered with the gateway.

        Raises:
            RuntimeError: If a service exits or is not ready in time (everything is stopped).
        """
        config = self.config
        self._check_ports()
        try:
            # NOTE: fetch and prepare once here, with progress bars; the instances then find
            # the prepared directory and load it.
            model = resolve_model(config.model, show_progress=True)
            self._make_certs()
            self._start_fork_server()
            self._start_gateways()
            # NOTE: one machine, several engines: each gets its share of the cores, since
            # oversubscribed torch threads make small kernels far slower.
            threads = max(1, (os.cpu_count() or 1) // (config.prefills + config.decodes))
            common = ["--model", str(model.path), "--served-model-name", model.name,
                      "--host", config.host, "--port", "0",
                      "--metrics-port", "0", "--num-threads", str(threads)]  # fmt: skip
            if config.registry is not None:
                common += ["--registry", config.registry]
            else:
                common += ["--gateway", f"{config.host}:{self.internal_port}"]
            if config.kv_store is not None:
                common += ["--kv-store", config.kv_store]
            for i in range(config.prefills):
                args = [*common, *shlex.split(config.prefill_args)]
                self.prefills.append(self._spawn(f"prefill-{i}", "pdserve.prefill", args))
            team = decode_team_args(config.decodes, os.cpu_count() or 1, cpu_flags())
            for i in range(config.decodes):
                args = [*common, *team, *shlex.split(config.decode_args)]
                self.decodes.append(self._spawn(f"decode-{i}", "pdserve.decode", args))
            deadline = time.monotonic() + config.startup_timeout_s
            for child in [*self.prefills, *self.decodes]:
                child.wait_for_event("registered", max(1.0, deadline - time.monotonic()))
            if self.fork_server is not None:
                self.fork_server.settle()
        except BaseException:
            self.stop(timeout_s=5)
            raise

    def _check_ports(self) -> None:
        """Refuses at once a gateway port another process listens on (an earlier `pdserve up`
        still running, say), before anything starts; the gateway would fail on it later."""
        config = self.config
        for index in range(config.gateways):
            for flag, port in zip(GATEWAY_PORT_FLAGS, self._asked_ports(index), strict=True):
                if port and not _is_free(config.host, port):
                    raise RuntimeError(
                        f"port {port} on {config.host} is in use (another pdserve up still "
                        f"running?); stop that, or pick free ports with {flag}"
                    )

    def _start_gateways(self) -> None:
        """Starts every gateway, then waits for each to serve (ports from its start-up log)."""
        config = self.config
        for i in range(config.gateways):
            ports = self._asked_ports(i)
            name = gateway_name(i)
            self.gateways.append(self._spawn(name, "pdserve.gateway", self._gateway_args(*ports)))
        for gateway in self.gateways:
            started = gateway.wait_for_event("gateway_started", config.startup_timeout_s)
            self.http_ports.append(started["http_port"])
            self.grpc_ports.append(started["grpc_port"])
            self.internal_ports.append(started["internal_port"])
            # NOTE: a restart binds the ports it got, not 0 again: clients and instances
            # know it by them.
            ports = [started["http_port"], started["grpc_port"], started["internal_port"]]
            self._commands[gateway.name] = ("pdserve.gateway", self._gateway_args(*ports))

    def _asked_ports(self, index: int) -> list[int]:
        """Gateway `index`'s REST, public gRPC and internal ports as the flags ask for them
        (each flag's port + `index`; 0: any free one)."""
        config = self.config
        return [
            port + index if port else 0
            for port in (config.port, config.grpc_port, config.internal_port)
        ]

    def _gateway_args(self, port: int, grpc_port: int, internal_port: int) -> list[str]:
        config = self.config
        registry = [] if config.registry is None else ["--registry", config.registry]
        return ["--host", config.host, "--port", str(port), "--grpc-port", str(grpc_port),
                "--internal-port", str(internal_port), *registry,
                *shlex.split(config.gateway_args)]  # fmt: skip

    def metrics_urls(self) -> list[str]:
        """``/metrics`` URLs of every gateway and every backend (from their start-up logs)."""
        urls = [f"{url}/metrics" for url in self.rest_urls]
        for child in [*self.prefills, *self.decodes]:
            for record in child.events:
                if record.get("event") == "metrics_started":
                    urls.append(f"http://{record['address']}/metrics")
        return urls

    def kv_cache_sizes(self) -> dict[str, dict[str, Any]]:
        """The ``kv_cache_sized`` record (blocks, tokens, bytes, how they were chosen) each
        decode and prefill logged at start, by name."""
        sizes: dict[str, dict[str, Any]] = {}
        for child in [*self.decodes, *self.prefills]:
            for record in list(child.events):
                if record.get("event") == "kv_cache_sized":
                    sizes[child.name] = record
                    break
        return sizes

    def first_exited(self) -> ChildProcess | None:
        """A child that has exited, if any."""
        return next((c for c in self.children if c.returncode is not None), None)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the backends (they drain), then to the gateways; SIGKILL what remains."""
        for members in ([*self.prefills, *self.decodes], self.gateways):
            for child in members:
                child.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for child in members:
                child.wait(max(0.1, deadline - time.monotonic()))
        for child in self.children:
            child.close()
        if self.fork_server is not None:
            self.fork_server.close()
            self.fork_server = None
        if self.tls_dir is not None:
            shutil.rmtree(self.tls_dir, ignore_errors=True)


GATEWAY_PORT_FLAGS = ("--port", "--grpc-port", "--internal-port")
"""The flags of `Cluster._asked_ports`' ports, in its order."""


def _is_free(host: str, port: int) -> bool:
    """Whether a listening socket could bind `host:port` now, with the options gRPC's and
    uvicorn's servers set (address reuse)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def gateway_name(index: int) -> str:
    """The name (process, log file, certificate) of gateway `index`: ``gateway``, then
    ``gateway-1``, ``gateway-2``, ..."""
    return "gateway" if index == 0 else f"gateway-{index}"
