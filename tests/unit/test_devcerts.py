"""Development certificates (meshbus certs, the demo): the names they are valid for, what
they may be used for, and files that are private and never overwritten."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from meshbus.devcerts import DevelopmentCA, host_name


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("127.0.0.1", x509.IPAddress(ipaddress.ip_address("127.0.0.1"))),
        ("::1", x509.IPAddress(ipaddress.ip_address("::1"))),
        ("localhost", x509.DNSName("localhost")),
        ("b-1.example.org", x509.DNSName("b-1.example.org")),
        ("*.lan", x509.DNSName("*.lan")),
    ],
)
def test_a_host_is_an_ip_address_or_a_dns_name(text: str, name: x509.GeneralName) -> None:
    assert host_name(text) == name


@pytest.mark.parametrize("text", ["", "a b", "host:7400", "-a.example", "a..b", "ünï.example"])
def test_what_is_neither_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="neither an IP address nor a DNS name"):
        host_name(text)


def test_a_certificate_names_every_host_and_serves_both_ends(tmp_path: Path) -> None:
    ca = DevelopmentCA("test CA", datetime.timedelta(days=2))
    ca.write_ca(str(tmp_path / "ca.pem"))
    files = ca.issue(
        "b1", ["localhost", "127.0.0.1"], str(tmp_path / "b.crt"), str(tmp_path / "b.key")
    )
    cert = x509.load_pem_x509_certificate((tmp_path / "b.crt").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.issuer == ca.certificate.subject
    assert cert.not_valid_after_utc - cert.not_valid_before_utc < datetime.timedelta(days=3)
    assert ca.certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for path in (tmp_path / "ca.pem", Path(files.cert), Path(files.key)):
        assert (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(FileExistsError):
        ca.issue("b1", ["localhost"], files.cert, str(tmp_path / "other.key"))
