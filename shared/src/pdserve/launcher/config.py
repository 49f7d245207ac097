"""The settings of `pdserve up` (`ClusterConfig`): what `Cluster` starts, and its ``--help``."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pdserve.common.config import setting
from pdserve.common.etcd_registry import REGISTRY_HELP, check_registry_spec
from pdserve.engine.model_store import DEFAULT_MODEL, MODEL_HELP


@dataclass(frozen=True)
class ClusterConfig:
    """Settings of `pdserve up`; field help texts are its ``--help``."""

    model: str = setting(DEFAULT_MODEL, MODEL_HELP)
    prefills: int = setting(1, "number of prefill instances")
    decodes: int = setting(1, "number of decode instances")
    gateways: int = setting(
        1,
        "number of gateways; more than one needs --registry (gateway i listens on "
        "--port + i, --grpc-port + i and --internal-port + i)",
    )
    registry: str | None = setting(None, REGISTRY_HELP + "; the etcd must already run")
    host: str = setting("127.0.0.1", "address every service binds")
    port: int = setting(8000, "gateway REST port (OpenAI API)")
    grpc_port: int = setting(50050, "gateway public gRPC port (GenerationService)")
    internal_port: int = setting(50051, "gateway internal gRPC port (RegistryService; mutual TLS)")
    insecure: bool = setting(
        False,
        "run the internal plane in plaintext instead of mutual TLS under a "
        "throwaway CA (every service logs a warning)",
    )
    prefill_args: str = setting("", 'extra flags for every prefill, e.g. "--num-blocks 512"')
    decode_args: str = setting("", 'extra flags for every decode, e.g. "--num-blocks 32"')
    gateway_args: str = setting("", "extra flags for every gateway")
    kv_store: str | None = setting(
        None,
        "KV storage tier for every prefill and decode (their --kv-store): "
        "file:DIR[?max_bytes=N] or redis://HOST:PORT[/DB]; off if unset",
    )
    fork_server: bool = setting(
        True,
        "fork every gateway, prefill and decode from one process that imported "
        "torch and the services' modules once: their pages are shared (on the default "
        "model each engine's proportional memory is about 115 MB less, the cluster's 0.82x "
        "with the server's own) and a service starts, or restarts, without importing. "
        "--no-fork-server starts each as its own python process (as it also does where "
        "the fork server cannot start)",
    )
    log_dir: str | None = setting(None, "where each service's log goes; a temp dir when unset")
    startup_timeout_s: float = setting(120.0, "how long services may take to become ready")
    max_restarts: int = setting(
        5,
        "how many times in a row a gateway, prefill or decode that exits (crash, "
        "kill, any status) is started again, with the same flags and, for a gateway, the "
        "same ports, while the others keep serving; once they run out, pdserve up stops "
        "the cluster and exits with status 1. A service that ran 60 s before it exited "
        "starts counting again. 0: any exit stops the cluster",
    )
    restart_backoff_s: float = setting(
        1.0,
        "seconds to wait before the first restart of a service that exited; each "
        "restart in a row waits twice as long as the one before, up to 30 s",
    )
    log_level: str = setting("info", "log level of the services", choices=("debug", "info"))

    def __post_init__(self) -> None:
        if self.log_level not in ("debug", "info"):
            raise ValueError("log_level must be debug or info (readiness is read from the logs)")
        if self.prefills < 1 or self.decodes < 1:
            raise ValueError("a cluster needs at least one prefill and one decode")
        if self.gateways < 1:
            raise ValueError("a cluster needs at least one gateway")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, got {self.max_restarts}")
        if self.restart_backoff_s < 0:
            raise ValueError(f"restart_backoff_s must be 0 or more, got {self.restart_backoff_s}")
        try:
            check_registry_spec(self.registry)
        except ValueError as error:
            raise ValueError(f"--registry: {error}") from None
        if self.gateways > 1 and self.registry is None:
            raise ValueError(
                f"--gateways {self.gateways} needs --registry etcd://HOST:PORT: without a shared "
                "registry each gateway would only know the instances registered with it"
            )
        for name in ("prefill_args", "decode_args", "gateway_args"):
            shlex.split(getattr(self, name))  # raises ValueError for unbalanced quotes
        if self.kv_store is not None:
            from pdserve.kv.stores import check_store_spec  # NOTE: loads torch

            try:
                check_store_spec(self.kv_store)
            except ValueError as error:
                raise ValueError(f"kv_store: {error}") from None
