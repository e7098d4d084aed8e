"""Users, broker keys and TLS certificates for the security benchmarks, made at run time.

``Security`` writes everything into a temporary directory that lives as long as the
command (nothing is ever committed): with ``users``, a broker config file with one user
(``bench``, a fresh Ed25519 key pair) allowed everything (``users_entry(...,
allow_all=True)``) and, for a mesh, a ``[[brokers]]`` entry and a key file per broker;
with ``tls``, a CA and a certificate for 127.0.0.1 from ``trustme`` (the tests' tool),
used by the meshbus brokers (``--tls-cert``/``--tls-key``) and by nats-server
(``--tls --tlscert --tlskey``) alike, and a client context that trusts the CA.
"""

from __future__ import annotations

import contextlib
import ssl
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click

from meshbus.auth import Credentials, brokers_entry, users_entry
from meshbus.private_files import write_private

USER = "bench"
AUTH_KIND = "meshbus_auth"  # the meshbus brokers with users, beside those without (--auth both)
AUTH_CHOICES = ("off", "on", "both")

F = TypeVar("F", bound=Callable[..., Any])
LOOPBACK = "127.0.0.1"


@dataclass
class Security:
    """What brokers are started with and what clients sign in and connect with."""

    directory: Path
    auth: str = "off"  # AUTH_CHOICES: which meshbus brokers have users
    credentials: Credentials | None = None  # the bench user's, when brokers have users
    config: Path | None = None
    broker_keys: list[Path] = field(default_factory=list)  # for a mesh with users
    cert: Path | None = None  # with TLS: the brokers' certificate chain and key
    key: Path | None = None
    ca: Path | None = None

    @property
    def tls(self) -> bool:
        return self.ca is not None

    def kinds(self) -> list[str]:
        """The meshbus systems to measure, in order: "meshbus" (with users when --auth
        on) and, with --auth both, "meshbus_auth" after it."""
        return ["meshbus", AUTH_KIND] if self.auth == "both" else ["meshbus"]

    def users_for(self, kind: str) -> bool:
        """Whether the brokers of system ``kind`` have users."""
        return kind == AUTH_KIND or (kind == "meshbus" and self.auth == "on")

    def credentials_for(self, kind: str) -> Credentials | None:
        """What the clients of system ``kind`` sign in with."""
        return self.credentials if self.users_for(kind) else None

    def label(self) -> str:
        """What the title of a table says about it."""
        parts = [f"users {self.auth}"] if self.auth != "off" else []
        return "".join(f", {part}" for part in (*parts, *(["TLS"] if self.tls else [])))

    def broker_args(self, kind: str = "meshbus", index: int = 0) -> tuple[str, ...]:
        """The flags of broker ``index`` of system ``kind`` (with users: the config file,
        and in a mesh its name and key)."""
        args: list[str] = []
        users = self.users_for(kind)
        if users and self.config is not None:
            args += ["--config", str(self.config)]
        if users and self.broker_keys:
            args += ["--name", broker_name(index), "--broker-key", str(self.broker_keys[index])]
        if self.cert is not None and self.key is not None:
            args += ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]
            if self.ca is not None and len(self.broker_keys) > 1:
                args += ["--tls-ca", str(self.ca)]  # it dials its peers with TLS
        return tuple(args)

    def nats_args(self) -> tuple[str, ...]:
        """nats-server's flags for the same certificate (none without TLS)."""
        if self.cert is None or self.key is None:
            return ()
        return ("--tls", "--tlscert", str(self.cert), "--tlskey", str(self.key))

    def client_context(self) -> ssl.SSLContext | None:
        """A client context that trusts the CA; None without TLS."""
        if self.ca is None:
            return None
        return ssl.create_default_context(cafile=str(self.ca))


def broker_name(index: int) -> str:
    return f"b{index}"


@contextlib.contextmanager
def security(auth: str = "off", tls: bool = False, brokers: int = 1) -> Iterator[Security]:
    """A ``Security`` for meshbus systems of ``brokers`` brokers (``auth``: none, all or
    one of two systems with users), its files removed on exit."""
    with tempfile.TemporaryDirectory(prefix="meshbus-bench-security-") as name:
        made = Security(Path(name), auth)
        if auth != "off":
            _write_users(made, brokers)
        if tls:
            _write_certificates(made)
        yield made


def _write_users(made: Security, brokers: int) -> None:
    made.credentials = Credentials.generate(USER)
    assert made.credentials.public_key is not None
    text = users_entry(USER, public_key=made.credentials.public_key, allow_all=True)
    if brokers > 1:
        # A broker with users takes only the brokers [[brokers]] lists (docs/security.md).
        for index in range(brokers):
            key = Credentials.generate(broker_name(index))
            path = made.directory / f"{broker_name(index)}.key"
            key.write(path)
            assert key.public_key is not None
            made.broker_keys.append(path)
            text += brokers_entry(broker_name(index), key.public_key)
    made.config = made.directory / "broker.toml"
    made.config.write_text(text)


def _write_certificates(made: Security) -> None:
    import trustme  # a development dependency, as for the TLS tests

    ca = trustme.CA()
    made.ca = made.directory / "ca.pem"
    ca.cert_pem.write_to_path(str(made.ca))
    leaf = ca.issue_cert(LOOPBACK, "localhost")
    made.cert = made.directory / "server.crt"
    made.key = made.directory / "server.key"
    for blob in leaf.cert_chain_pems:
        blob.write_to_path(str(made.cert), append=True)
    write_private(made.key, leaf.private_key_pem.bytes())


def auth_option(command: F) -> F:
    """--auth: meshbus brokers with users (and permissions), the bench's links signed in."""
    return click.option(
        "--auth",
        type=click.Choice(AUTH_CHOICES),
        default="off",
        show_default=True,
        help="meshbus brokers with a user allowed everything, the links signed in with its "
        "key pair (a mesh's brokers with [[brokers]] keys): off, on, or both (systems "
        "without and with users alternating; the last line adds meshbus_auth and "
        "auth_ratio = with / without).",
    )(command)


def tls_option(command: F) -> F:
    """--tls: every server and link of the command over TLS."""
    return click.option(
        "--tls",
        is_flag=True,
        help="TLS on every link: meshbus brokers with --tls-cert/--tls-key, nats-server "
        "with --tls (a CA and certificate for 127.0.0.1 made at run time).",
    )(command)
