"""Development certificates: a throwaway CA and certificates it signs, for trying TLS on
one machine or a test network (``meshbus certs``, the demo). NOT for production: the
CA's key is thrown away (no certificate can be added or revoked later) and nothing
here is what an organisation's PKI checks before it signs.

Every certificate names its hosts in the subject alternative names -- DNS names and IP
addresses alike, ``localhost`` and ``127.0.0.1`` included -- since a client checks the
host it dialled there (docs/security.md, "What is checked"), and the common name is
never looked at for that. A broker's certificate is good for both server and client
authentication: a broker shows it when it dials its peers too.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshbus.private_files import write_private

# A few minutes back: the clocks of two hosts are never quite the same.
_SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class CertificateFiles:
    """PEM files: a certificate and its private key."""

    cert: str
    key: str


def host_name(text: str) -> x509.GeneralName:
    """``text`` as a subject alternative name: an IP address (v4 or v6), or else a DNS
    name. ValueError for what is neither (empty, spaces, a port)."""
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        pass
    labels = text.removeprefix("*.").split(".")
    if not text or len(text) > 253 or not all(_dns_label(label) for label in labels):
        raise ValueError(
            f"{text!r} is neither an IP address nor a DNS name (letters, digits, '-' and "
            "'.'; no port)"
        )
    return x509.DNSName(text)


def _dns_label(label: str) -> bool:
    return (
        0 < len(label) <= 63
        and label.replace("-", "").isalnum()
        and label.isascii()
        and not label.startswith("-")
        and not label.endswith("-")
    )


class DevelopmentCA:
    """A new CA (an EC P-256 key, in memory only) that issues certificates valid for
    ``validity`` from now."""

    def __init__(self, common_name: str, validity: datetime.timedelta) -> None:
        self._now = datetime.datetime.now(datetime.UTC)
        self._validity = validity
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        self.certificate = (
            self._builder(self._name, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(cert_sign=True), critical=True)
            .sign(self._key, hashes.SHA256())
        )

    def write_ca(self, path: str) -> None:
        """The CA's certificate: what clients and brokers are given as --tls-ca."""
        write_private(path, self.certificate.public_bytes(serialization.Encoding.PEM))

    def issue(
        self, common_name: str, hosts: Sequence[str], cert_path: str, key_path: str
    ) -> CertificateFiles:
        """A certificate for ``hosts`` (its subject alternative names; none for a
        client's) with a new key, written to the two paths (0600; never over a file:
        FileExistsError). Good for server and client authentication."""
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        builder = (
            self._builder(name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if hosts:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([host_name(host) for host in hosts]),
                critical=False,
            )
        cert = builder.sign(self._key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        write_private(key_path, key_pem)
        write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return CertificateFiles(cert_path, key_path)

    def _builder(
        self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey
    ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._now - _SKEW)
            .not_valid_after(self._now + self._validity)
        )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )
