"""The cluster's certificates: a CA, and one certificate per service that names its identity.

A service's identity is its role and instance id, carried in its certificate's SANs:

* the URI SAN ``spiffe://pdserve.internal/<role>/<instance_id>`` (a SPIFFE ID: what servers
  read to authorize a caller),
* the DNS SAN ``<instance_id>.<role>.pdserve.internal`` (what a client checks when it must
  reach one particular instance, e.g. the decode a gateway named), and
* the DNS SAN ``<role>.pdserve.internal`` (what a client checks when any instance of the role
  will do, e.g. the gateway an instance registers with), and
* the DNS SAN ``pdserve.internal`` (any member of the cluster: status and health polls of an
  instance whose role the caller does not know).

Clients verify these names (``grpc.ssl_target_name_override``), not the address they dialled,
so a certificate stays valid when an instance moves; ``hosts`` adds the machine's names and
addresses for tools that verify by address. Keys are ECDSA P-256.
"""

from __future__ import annotations

import datetime
import ipaddress
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TRUST_DOMAIN = "pdserve.internal"
ROLES = ("gateway", "prefill", "decode", "client")
"""Roles a certificate may carry; ``client`` is an operator's tool (status, health)."""
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
MEMBER_DNS_NAME = TRUST_DOMAIN
"""The name every cluster certificate carries (a client that accepts any member checks it)."""
DEFAULT_DAYS = 365
_CA_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)
_SERVICE_USAGE = x509.ExtendedKeyUsage(
    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
)


@dataclass(frozen=True)
class Identity:
    """Who a certificate speaks for.

    Raises:
        ValueError: For an unknown role, or an instance id that is not a DNS label
            (lower-case letters, digits and inner hyphens, at most 63 characters).
    """

    role: str
    instance_id: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not _LABEL.match(self.instance_id):
            raise ValueError(
                f"instance id {self.instance_id!r} must be a DNS label: lower-case letters, "
                "digits and inner hyphens, at most 63 characters"
            )

    @property
    def spiffe_id(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/{self.role}/{self.instance_id}"

    @property
    def dns_name(self) -> str:
        """The name a client checks to reach exactly this instance."""
        return f"{self.instance_id}.{self.role}.{TRUST_DOMAIN}"

    def __str__(self) -> str:
        return f"{self.role}/{self.instance_id}"


def role_dns_name(role: str) -> str:
    """The name a client checks when any instance of `role` will do."""
    return f"{role}.{TRUST_DOMAIN}"


def instance_dns_name(role: str, instance_id: str) -> str:
    """The name a client checks to reach instance `instance_id` of `role`."""
    return f"{instance_id}.{role}.{TRUST_DOMAIN}"


def identity_from_spiffe_id(uri: str) -> Identity | None:
    """The identity named by a pdserve SPIFFE ID, or None for any other URI."""
    prefix = f"spiffe://{TRUST_DOMAIN}/"
    if not uri.startswith(prefix):
        return None
    role, _, instance_id = uri[len(prefix) :].partition("/")
    try:
        return Identity(role, instance_id)
    except ValueError:
        return None


@lru_cache(maxsize=256)
def identity_of_pem(cert_pem: bytes) -> Identity | None:
    """The pdserve identity in a PEM certificate's URI SANs, or None without one."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    for uri in names.get_values_for_type(x509.UniformResourceIdentifier):
        identity = identity_from_spiffe_id(uri)
        if identity is not None:
            return identity
    return None


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate and its PEM private key."""

    cert_pem: bytes
    key_pem: bytes


def new_ca(name: str = "pdserve cluster CA", days: int = DEFAULT_DAYS) -> KeyPair:
    """A self-signed CA that may sign service certificates (and nothing below them)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_KEY_USAGE, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(_cert_pem(cert), _key_pem(key))


def issue(
    ca: KeyPair,
    identity: Identity,
    hosts: tuple[str, ...] = (),
    days: int = DEFAULT_DAYS,
    not_before: datetime.datetime | None = None,
) -> KeyPair:
    """A certificate for `identity`, signed by `ca`, valid as server and client.

    Args:
        ca: The cluster CA.
        identity: Role and instance id the certificate speaks for.
        hosts: Extra DNS names or IP addresses of the machine (for tools that verify by
            address); pdserve's own clients verify the identity names.
        days: Validity from `not_before`.
        not_before: Start of validity; five minutes ago when None (tests pass past times).
    """
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key must be an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(identity.spiffe_id),
        x509.DNSName(identity.dns_name),
        x509.DNSName(role_dns_name(identity.role)),
        x509.DNSName(MEMBER_DNS_NAME),
    ]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.dns_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(_SERVICE_USAGE, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return KeyPair(_cert_pem(cert), _key_pem(key))


@dataclass(frozen=True)
class TlsFiles:
    """Where one service's CA certificate, certificate and key lie."""

    ca: Path
    cert: Path
    key: Path


def write_ca(directory: Path, ca: KeyPair) -> None:
    """Writes ``ca.crt`` and ``ca.key`` (owner-only) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca.crt").write_bytes(ca.cert_pem)
    _write_private(directory / "ca.key", ca.key_pem)


def read_ca(directory: Path) -> KeyPair:
    """The CA in `directory` (``ca.crt`` and ``ca.key``)."""
    return KeyPair((directory / "ca.crt").read_bytes(), (directory / "ca.key").read_bytes())


def write_identity(directory: Path, ca: KeyPair, pair: KeyPair, name: str) -> TlsFiles:
    """Writes ``<name>.crt`` and ``<name>.key`` (owner-only) beside ``ca.crt``."""
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "ca.crt", directory / f"{name}.crt", directory / f"{name}.key")
    if not files.ca.exists():
        files.ca.write_bytes(ca.cert_pem)
    files.cert.write_bytes(pair.cert_pem)
    _write_private(files.key, pair.key_pem)
    return files


def _write_private(path: Path, data: bytes) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_bytes(data)


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
