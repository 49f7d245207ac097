"""One cluster CA per test process, and certificates for any role and instance id on demand."""

from __future__ import annotations

import atexit
import functools
import itertools
import shutil
import tempfile
from pathlib import Path

import grpc

from pdserve.common import pki
from pdserve.common.security import Security


class ClusterPki:
    """A CA in a private temporary directory; certificates are made once per identity.

    Args:
        directory: Where ``ca.crt`` and the certificates go.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca = pki.new_ca(name="pdserve test CA")
        pki.write_ca(directory, self.ca)
        self._files: dict[pki.Identity, pki.TlsFiles] = {}
        self._ids = itertools.count()

    def files(self, role: str, instance_id: str) -> pki.TlsFiles:
        identity = pki.Identity(role, instance_id)
        if identity not in self._files:
            pair = pki.issue(self.ca, identity)
            self._files[identity] = pki.write_identity(
                self.directory, self.ca, pair, f"{role}-{instance_id}"
            )
        return self._files[identity]

    def new_id(self, role: str) -> str:
        """A fresh instance id for `role` (``prefill-3``)."""
        return f"{role}-{next(self._ids)}"

    def config(self, role: str, instance_id: str | None = None) -> dict[str, str]:
        """Config fields for a service of `role` (a fresh instance id when None)."""
        files = self.files(role, instance_id or self.new_id(role))
        return {"tls_ca": str(files.ca), "tls_cert": str(files.cert), "tls_key": str(files.key)}

    def args(self, role: str, instance_id: str | None = None) -> list[str]:
        """The ``--tls-*`` flags for a service process of `role`."""
        config = self.config(role, instance_id)
        return ["--tls-ca", config["tls_ca"], "--tls-cert", config["tls_cert"],
                "--tls-key", config["tls_key"]]  # fmt: skip

    def security(self, role: str, instance_id: str) -> Security:
        files = self.files(role, instance_id)
        return Security.from_files(files.ca, files.cert, files.key)

    def channel(
        self,
        address: str,
        role: str = "client",
        instance_id: str = "tester",
        server_name: str = pki.MEMBER_DNS_NAME,
    ) -> grpc.aio.Channel:
        """A channel to a cluster member, presenting a `role` certificate."""
        return self.security(role, instance_id).channel(address, server_name)


@functools.cache
def cluster_pki() -> ClusterPki:
    """The process-wide test CA (removed at exit)."""
    directory = Path(tempfile.mkdtemp(prefix="pdserve-test-pki-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return ClusterPki(directory)
