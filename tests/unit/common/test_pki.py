"""Cluster certificates: identities, `Security` from flags, and the `pdserve certs` command."""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import pytest
from cryptography import x509

from pdserve.common import pki
from pdserve.common.config import ServiceConfig
from pdserve.common.security import Security
from pdserve.launcher.__main__ import main


def test_a_certificate_carries_its_identity_as_spiffe_id_and_dns_names() -> None:
    ca = pki.new_ca()
    identity = pki.Identity("decode", "decode-7")
    pair = pki.issue(ca, identity, hosts=("10.0.0.2", "node-2"))
    assert pki.identity_of_pem(pair.cert_pem) == identity
    cert = x509.load_pem_x509_certificate(pair.cert_pem)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://pdserve.internal/decode/decode-7"
    ]
    assert names.get_values_for_type(x509.DNSName) == [
        "decode-7.decode.pdserve.internal", "decode.pdserve.internal", "pdserve.internal", "node-2"
    ]  # fmt: skip
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.2"]
    assert pki.identity_of_pem(ca.cert_pem) is None


@pytest.mark.parametrize(
    ("role", "instance_id"),
    [("admin", "x"), ("prefill", "Prefill-A"), ("prefill", "a_b"), ("decode", "-a"),
     ("decode", "a" * 64), ("gateway", "")],
)  # fmt: skip
def test_identities_are_roles_and_dns_labels(role: str, instance_id: str) -> None:
    with pytest.raises(ValueError):
        pki.Identity(role, instance_id)


@pytest.mark.parametrize(
    "uri",
    ["spiffe://other.domain/prefill/p", "spiffe://pdserve.internal/root/p",
     "spiffe://pdserve.internal/prefill/", "https://pdserve.internal/prefill/p"],
)  # fmt: skip
def test_foreign_spiffe_ids_name_no_identity(uri: str) -> None:
    assert pki.identity_from_spiffe_id(uri) is None


def _write(tmp_path: Path, role: str, instance_id: str) -> pki.TlsFiles:
    ca = pki.new_ca()
    return pki.write_identity(tmp_path, ca, pki.issue(ca, pki.Identity(role, instance_id)), "svc")


def test_security_from_flags_takes_the_certificates_identity(tmp_path: Path) -> None:
    files = _write(tmp_path, "prefill", "prefill-a")
    config = ServiceConfig(tls_ca=str(files.ca), tls_cert=str(files.cert), tls_key=str(files.key))
    security = Security.from_config(config, "prefill")
    assert security.identity == pki.Identity("prefill", "prefill-a")
    assert security.instance_id(None) == "prefill-a"
    with pytest.raises(ValueError, match="differs from the certificate's instance id"):
        security.instance_id("prefill-b")
    with pytest.raises(ValueError, match="is a prefill certificate; this service is a decode"):
        Security.from_config(config, "decode")
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600


def test_security_refuses_missing_files_and_foreign_certificates(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tls-ca"):
        Security.from_files(tmp_path / "nope.crt", tmp_path / "a", tmp_path / "b")
    ca = pki.new_ca()
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    (tmp_path / "ca.key").write_bytes(ca.key_pem)
    with pytest.raises(ValueError, match="names no pdserve identity"):
        Security.from_files(tmp_path / "ca.crt", tmp_path / "ca.crt", tmp_path / "ca.key")


def test_insecure_is_explicit_and_logged(capsys: pytest.CaptureFixture[str]) -> None:
    security = Security.from_config(ServiceConfig(insecure=True), "decode")
    assert security.is_insecure and security.describe() == "insecure"
    assert security.instance_id("d-1") == "d-1"
    assert "internal_plane_insecure" in capsys.readouterr().out


def test_pdserve_certs_makes_a_ca_and_service_certificates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certs", "init", "--dir", str(tmp_path)]) == 0
    assert main(["certs", "init", "--dir", str(tmp_path)]) == 1
    assert "exists" in capsys.readouterr().err
    argv = ["certs", "issue", "--dir", str(tmp_path), "--role", "decode",
            "--instance-id", "decode-east-1", "--host", "10.1.2.3", "--days", "30"]  # fmt: skip
    assert main(argv) == 0
    cert = (tmp_path / "decode-east-1.crt").read_bytes()
    assert pki.identity_of_pem(cert) == pki.Identity("decode", "decode-east-1")
    parsed = x509.load_pem_x509_certificate(cert)
    lifetime = parsed.not_valid_after_utc - parsed.not_valid_before_utc
    assert lifetime == datetime.timedelta(days=30)
    files = pki.TlsFiles(tmp_path / "ca.crt", tmp_path / "decode-east-1.crt",
                         tmp_path / "decode-east-1.key")  # fmt: skip
    assert Security.from_files(files.ca, files.cert, files.key).identity is not None
    assert main([*argv[:6], "--instance-id", "Bad_Id"]) == 1
    assert "DNS label" in capsys.readouterr().err


def test_unusable_certificate_files_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdserve.decode.__main__ import main as decode_main

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match="must be a PEM certificate"):
        Security.from_files(garbage, garbage, garbage)
    flags = ["--tls-ca", str(garbage), "--tls-cert", str(garbage), "--tls-key", str(garbage)]
    assert decode_main(flags) == 2
    assert "must be a PEM certificate" in capsys.readouterr().err
