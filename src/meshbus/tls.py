"""TLS on every link: the SSL contexts of a broker, of its dials to peers and of a client,
made in one place, and the words for a TLS failure (docs/security.md, "TLS").

Nothing here runs per frame: a context is made once -- when a broker starts, when a
client connects -- and a link's bytes then go through the event loop's TLS transport.
Every failure to load a file or to finish a handshake becomes a ``TLSError`` whose
message names the file or the cause, and what to do about it.
"""

from __future__ import annotations

import os
import ssl
from typing import TypeAlias

from meshbus.errors import TLSError
from meshbus.util import parse_hostport

# What ``meshbus.connect(tls=...)`` takes: True (the system's CAs), a CA file, a context
# of the caller's own (client certificates, pinning, ...); None or False for plain TCP.
TLSOption: TypeAlias = bool | str | os.PathLike[str] | ssl.SSLContext | None

# OpenSSL's X509_V_ERR_* codes (ssl.SSLCertVerificationError.verify_code) we explain.
_UNKNOWN_CA = frozenset({2, 18, 19, 20, 21})
_NOT_YET_VALID = 9
_EXPIRED = 10
_WRONG_PURPOSE = 26
_NAME_MISMATCH = frozenset({62, 64})  # host name, IP address
# OpenSSL's reasons when the other end answered a ClientHello with bytes that are not TLS.
_NOT_TLS = frozenset(
    {"WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE", "HTTP_REQUEST"}
)


# -- contexts ------------------------------------------------------------------------------


def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """A broker's listening context: its certificate and key; with ``ca``, client
    certificates signed by it are asked for -- peer brokers must show one, and with
    --tls-verify-clients every link (meshbus.broker.security.acceptor)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _load_chain(context, cert, key)
    if ca:
        _load_ca(context, ca)
        # Optional, not required: a link with no certificate finishes the TLS handshake
        # and the broker then refuses it, if it must, with an ERROR that says why. A TLS
        # 1.3 client refused inside the handshake learns nothing it can show. A
        # certificate that is sent and does not verify still fails the handshake.
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


def dial_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """A broker's context for dialling its peers: it checks theirs against ``ca`` (the
    system's CAs if empty) and shows its own certificate, as a client certificate."""
    context = ssl.create_default_context()
    if ca:
        _load_ca(context, ca)
    _load_chain(context, cert, key)
    return context


def client_context(tls: TLSOption) -> ssl.SSLContext | None:
    """The context ``meshbus.connect(tls=...)`` dials with; None for plain TCP."""
    if tls is None or tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    context = ssl.create_default_context()
    if tls is not True:
        if not isinstance(tls, str | os.PathLike):
            raise TypeError(
                f"tls must be True, a CA file path or an ssl.SSLContext, not {type(tls).__name__}"
            )
        _load_ca(context, os.fspath(tls))
    return context


def cli_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The context of a CLI client command's --tls-ca, --tls-cert and --tls-key: any of
    them turns TLS on; without --tls-ca the broker is checked against the system's CAs."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise TLSError("--tls-cert and --tls-key go together: give both, or neither")
    context = client_context(ca or True)
    assert context is not None
    if cert and key:
        _load_chain(context, cert, key)
    return context


def _read_error(what: str, path: str, exc: OSError) -> TLSError:
    return TLSError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}")


def _load_ca(context: ssl.SSLContext, path: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as exc:
        raise TLSError(f"the TLS CA file {path} holds no PEM certificate ({_words(exc)})") from None
    except OSError as exc:
        raise _read_error("CA file", path, exc) from None


def _load_chain(context: ssl.SSLContext, cert: str, key: str) -> None:
    for what, path in (("certificate", cert), ("key", key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise _read_error(what, path, exc) from None
    try:
        # A password callback, so an encrypted key fails here rather than prompting on a
        # terminal that a broker may not have.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TLSError(f"the TLS key {key} does not belong to the certificate {cert}") from None
        with open(cert, "rb") as file:
            has_cert = b"-----BEGIN CERTIFICATE-----" in file.read()
        if not has_cert:
            raise TLSError(f"the TLS certificate {cert} holds no PEM certificate") from None
        raise TLSError(
            f"the TLS key {key} is not an unencrypted PEM private key ({_words(exc)})"
        ) from None


# -- failures ------------------------------------------------------------------------------


def _words(exc: ssl.SSLError) -> str:
    """OpenSSL's reason as words: WRONG_VERSION_NUMBER -> wrong version number."""
    return (exc.reason or exc.strerror or str(exc)).lower().replace("_", " ")


def failure_reason(exc: BaseException) -> str:
    """A failed TLS handshake, in a few words, for a log line."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate refused: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        if exc.reason in _NOT_TLS:
            return f"the other end does not speak TLS ({_words(exc)})"
        return _words(exc)
    if isinstance(exc, OSError) and exc.errno:
        return f"the link closed during the TLS handshake ({os.strerror(exc.errno)})"
    return "the link closed during the TLS handshake"


def handshake_error(exc: ssl.SSLError, address: str) -> TLSError:
    """What a client tells its user when the TLS handshake with the broker at ``address``
    (HOST:PORT, as dialled) failed."""
    where = f"broker {address}"
    host = parse_hostport(address)[0]
    if isinstance(exc, ssl.SSLCertVerificationError):
        code, said = exc.verify_code, exc.verify_message
        if code in _UNKNOWN_CA:
            return TLSError(
                f"the certificate of {where} is signed by a CA this client does not trust "
                f"({said}); give the CA's certificate: --tls-ca FILE, or "
                "meshbus.connect(tls='ca.pem')"
            )
        if code in _NAME_MISMATCH:
            return TLSError(
                f"the certificate of {where} is not valid for {host!r}, the host dialled "
                f"({said}); dial a name the certificate lists, or issue it for {host!r}"
            )
        if code == _EXPIRED:
            return TLSError(f"the certificate of {where} has expired; the broker needs a new one")
        if code == _NOT_YET_VALID:
            return TLSError(
                f"the certificate of {where} is not valid yet; check the clocks of both hosts"
            )
        if code == _WRONG_PURPOSE:
            return TLSError(
                f"the certificate of {where} is not meant for a TLS server ({said}); "
                "issue one for server authentication"
            )
        return TLSError(f"the certificate of {where} was refused: {said}")
    if exc.reason in _NOT_TLS:
        return TLSError(
            f"{where} does not speak TLS (it answered the TLS handshake with something "
            f"else: {_words(exc)}); connect without TLS, or start the broker with "
            "--tls-cert and --tls-key"
        )
    if exc.reason and "ALERT" in exc.reason:
        return TLSError(
            f"{where} refused the TLS handshake ({_words(exc)}); if it requires client "
            "certificates, this client's must be signed by the broker's --tls-ca and valid"
        )
    return TLSError(f"the TLS handshake with {where} failed: {_words(exc)}")
