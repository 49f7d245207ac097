"""How a service speaks on the internal gRPC plane: mutual TLS under its identity, or plaintext.

`Security.from_config(config, role)` reads ``--tls-ca/--tls-cert/--tls-key`` (or honours
``--insecure``, with a warning) once at start. Every internal server binds through `bind`
(client certificates required and checked against the cluster CA) and every internal client
dials through `channel`, naming the identity it expects at the other end, so a certificate
from another CA, or of another role or instance, fails the handshake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from pdserve.common import grpc_server
from pdserve.common.config import ServiceConfig
from pdserve.common.grpc_server import CHANNEL_OPTIONS, insecure_channel
from pdserve.common.pki import Identity, identity_of_pem

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Security:
    """One service's internal-plane credentials; `identity` None means plaintext (insecure).

    Attributes:
        identity: Role and instance id from the service's certificate, or None when insecure.
    """

    identity: Identity | None
    _ca_pem: bytes = field(default=b"", repr=False)
    _cert_pem: bytes = field(default=b"", repr=False)
    _key_pem: bytes = field(default=b"", repr=False)

    @classmethod
    def insecure(cls) -> Security:
        """Plaintext: every caller that reaches a port is trusted."""
        return cls(None)

    @classmethod
    def from_files(cls, ca: str | Path, cert: str | Path, key: str | Path) -> Security:
        """Mutual TLS with the certificate at `cert` (its identity is the service's).

        Raises:
            ValueError: A file is missing or unreadable, or the certificate names no pdserve
                identity (it was not made by `pdserve certs`).
        """
        pems = []
        for flag, path in (("--tls-ca", ca), ("--tls-cert", cert), ("--tls-key", key)):
            try:
                pems.append(Path(path).read_bytes())
            except OSError as error:
                raise ValueError(f"{flag} {path}: {error.strerror or error}") from None
        try:
            x509.load_pem_x509_certificate(pems[0])
            identity = identity_of_pem(pems[1])
            serialization.load_pem_private_key(pems[2], password=None)
        except ValueError as error:
            raise ValueError(
                f"--tls-ca/--tls-cert/--tls-key ({ca}, {cert}, {key}) must be a PEM certificate, "
                f"a PEM certificate and its unencrypted PEM key: {error}"
            ) from None
        if identity is None:
            raise ValueError(
                f"--tls-cert {cert} names no pdserve identity (a spiffe://pdserve.internal/ROLE/ID"
                " URI); make it with `pdserve certs issue`"
            )
        return cls(identity, pems[0], pems[1], pems[2])

    @classmethod
    def from_config(cls, config: ServiceConfig, role: str) -> Security:
        """The service's security from its flags; warns when insecure.

        Raises:
            ValueError: As `from_files`, or when the certificate is of another role.
        """
        if config.insecure:
            log.warning(
                "internal_plane_insecure",
                detail="internal gRPC is plaintext: any caller that reaches these ports is "
                "trusted (started with --insecure)",
            )
            return cls.insecure()
        return cls.from_flags(config, role)

    @classmethod
    def from_flags(cls, config: ServiceConfig, role: str) -> Security:
        """Mutual TLS from ``--tls-ca/--tls-cert/--tls-key`` (the CLIs call it before serving,
        so a bad file is a usage error).

        Raises:
            ValueError: As `from_files`, or when the certificate is of another role.
        """
        assert config.tls_ca and config.tls_cert and config.tls_key  # checked by the config
        security = cls.from_files(config.tls_ca, config.tls_cert, config.tls_key)
        assert security.identity is not None
        if security.identity.role != role:
            raise ValueError(
                f"--tls-cert is a {security.identity.role} certificate; this service is a {role}"
            )
        return security

    @property
    def is_insecure(self) -> bool:
        return self.identity is None

    def instance_id(self, configured: str | None) -> str | None:
        """The instance id to run under: the certificate's (a different ``--instance-id`` is
        an error), or `configured` when insecure.

        Raises:
            ValueError: ``--instance-id`` differs from the certificate's instance id.
        """
        if self.identity is None:
            return configured
        if configured and configured != self.identity.instance_id:
            raise ValueError(
                f"--instance-id {configured!r} differs from the certificate's instance id "
                f"{self.identity.instance_id!r}"
            )
        return self.identity.instance_id

    def bind(self, server: grpc.aio.Server, address: str) -> int:
        """Binds `address` on `server` (mTLS, client certificates required); returns the port.

        Raises:
            ListenError: It cannot be bound.
        """
        if self.identity is None:
            return grpc_server.bind(server, address)
        credentials = grpc.ssl_server_credentials(
            [(self._key_pem, self._cert_pem)],
            root_certificates=self._ca_pem,
            require_client_auth=True,
        )
        return grpc_server.bind(server, address, credentials)

    def channel(self, address: str, server_name: str) -> grpc.aio.Channel:
        """A client channel to `address` whose server must present `server_name`.

        Args:
            address: host:port to dial.
            server_name: A DNS name from `pki` (`pki.role_dns_name`, `pki.instance_dns_name`)
                the server's certificate must carry; ignored when insecure.
        """
        if self.identity is None:
            return insecure_channel(address)
        options: list[tuple[str, str | int]] = list(CHANNEL_OPTIONS)
        credentials = grpc.ssl_channel_credentials(self._ca_pem, self._key_pem, self._cert_pem)
        options.append(("grpc.ssl_target_name_override", server_name))
        return grpc.aio.secure_channel(address, credentials, options=options)

    def describe(self) -> str:
        """``mtls <role>/<id>`` or ``insecure`` (for status and logs)."""
        return "insecure" if self.identity is None else f"mtls {self.identity}"
