"""meshbus.tls: the contexts it makes, and the files it refuses (each named in the error).

The handshakes themselves are tested against real brokers in
tests/integration/test_tls.py.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from meshbus.errors import TLSError
from meshbus.tls import cli_context, client_context, dial_context, server_context


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


@pytest.fixture
def pair(ca: trustme.CA, tmp_path: Path) -> tuple[str, str]:
    """(certificate file, key file) of a certificate for 127.0.0.1."""
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    return str(cert_file), str(key_file)


def test_no_tls_is_none() -> None:
    assert client_context(None) is None
    assert client_context(False) is None
    assert cli_context(None, None, None) is None


def test_a_client_always_checks_the_certificate_and_the_name(ca_file: str) -> None:
    for tls in (True, ca_file, Path(ca_file)):
        context = client_context(tls)
        assert context is not None
        assert context.verify_mode is ssl.CERT_REQUIRED
        assert context.check_hostname


def test_a_callers_context_is_used_as_given() -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    assert client_context(context) is context


def test_tls_of_another_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="tls must be"):
        client_context(42)  # type: ignore[arg-type]


def test_a_ca_asks_for_a_client_certificate(ca_file: str, pair: tuple[str, str]) -> None:
    assert server_context(*pair, "").verify_mode is ssl.CERT_NONE
    # Optional: the broker refuses a link without one itself (a peer broker always, any
    # link under mutual TLS), with an ERROR that says why.
    assert server_context(*pair, ca_file).verify_mode is ssl.CERT_OPTIONAL
    assert dial_context(*pair, ca_file).verify_mode is ssl.CERT_REQUIRED


def test_cert_and_key_go_together(pair: tuple[str, str]) -> None:
    with pytest.raises(TLSError, match="--tls-cert and --tls-key go together"):
        cli_context(None, pair[0], None)
    context = cli_context(None, *pair)  # the system's CAs, with a client certificate
    assert context is not None


def test_a_ca_file_that_is_not_pem_is_named(tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(TLSError, match=f"the TLS CA file {junk} holds no PEM certificate"):
        client_context(junk)


def test_a_missing_ca_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(TLSError, match=f"cannot read the TLS CA file {tmp_path}/none.pem"):
        client_context(tmp_path / "none.pem")


def test_a_certificate_file_without_a_certificate_is_named(
    tmp_path: Path, pair: tuple[str, str]
) -> None:
    _, key = pair
    with pytest.raises(TLSError, match=f"the TLS certificate {key} holds no PEM certificate"):
        server_context(key, key, "")


def test_an_encrypted_key_fails_without_asking_for_a_password(
    ca: trustme.CA, tmp_path: Path, pair: tuple[str, str]
) -> None:
    cert, key = pair
    private = serialization.load_pem_private_key(Path(key).read_bytes(), password=None)
    locked = tmp_path / "locked.pem"
    locked.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    with pytest.raises(TLSError, match=f"the TLS key {locked} is not an unencrypted PEM"):
        server_context(cert, str(locked), "")
