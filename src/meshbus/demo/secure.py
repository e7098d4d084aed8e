"""The demo runs as a mesh should: TLS on every link, every client signed in, every
broker proving itself to the others (docs/security.md). Everything it needs is made
at start in its work dir and goes with it: a throwaway CA and one certificate for
127.0.0.1 that every broker shows, a key pair per user and per broker, and the
brokers' config file listing them."""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass

from meshbus.auth import Credentials, brokers_entry, users_entry
from meshbus.cli.common import Access
from meshbus.devcerts import DevelopmentCA
from meshbus.private_files import write_private
from meshbus.tls import cli_context

HOST = "127.0.0.1"  # where the demo's brokers listen, and what their certificate names
USERS = ("mmo", "spark")  # the back end's connectors; the Spark jobs (and the report)
# Long enough for any run, short enough that a copy left behind is soon worthless.
VALIDITY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Certificates:
    """PEM files: the CA's certificate, and a certificate and key signed by it."""

    ca: str
    cert: str
    key: str


def write_certificates(directory: str, host: str) -> Certificates:
    """A new CA, and a certificate for ``host`` (an IP address) signed by it, good for
    both ends of a TLS link (a broker also shows it when it dials its peers)."""
    files = Certificates(
        *(os.path.join(directory, n) for n in ("ca.pem", "broker.crt", "broker.key"))
    )
    ca = DevelopmentCA("meshbus demo CA", VALIDITY)
    ca.write_ca(files.ca)
    ca.issue(host, [host], files.cert, files.key)
    return files


@dataclass(frozen=True)
class DemoSecurity:
    """The files of the demo's TLS, users and mesh trust, in its work dir."""

    config: str  # the brokers' config file: [[users]] and [[brokers]]
    certificates: Certificates
    credentials: dict[str, str]  # user -> credentials file
    broker_keys: dict[str, str]  # broker name -> its key pair's file

    def broker_args(self, name: str) -> list[str]:
        """The flags of broker ``name``: the config, its name and key, TLS."""
        certificates = self.certificates
        return [
            "--config", self.config, "--name", name, "--broker-key", self.broker_keys[name],
            "--tls-cert", certificates.cert, "--tls-key", certificates.key,
            "--tls-ca", certificates.ca,
        ]  # fmt: skip

    def access(self, user: str) -> Access:
        """How ``user`` connects: TLS checked against the demo's CA, signed in."""
        ca = self.certificates.ca
        return Access(cli_context(ca, None, None), self.credentials[user], tls_ca=ca)


def prepare(directory: str, brokers: Sequence[str]) -> DemoSecurity:
    """Certificates, the users' and ``brokers``' key pairs, and the config file listing
    them (every user allowed everything: the demo is about the bus, not its rules)."""
    certificates = write_certificates(directory, HOST)
    credentials: dict[str, str] = {}
    broker_keys: dict[str, str] = {}
    entries: list[str] = []
    for user in USERS:
        credentials[user], public_key = _key_pair(directory, user)
        entries.append(users_entry(user, public_key=public_key, allow_all=True))
    for broker in brokers:
        broker_keys[broker], public_key = _key_pair(directory, broker)
        entries.append(brokers_entry(broker, public_key))
    config = os.path.join(directory, "brokers.toml")
    write_private(config, "\n".join(entries).encode("utf-8"))
    return DemoSecurity(config, certificates, credentials, broker_keys)


def _key_pair(directory: str, user: str) -> tuple[str, str]:
    """A new key pair for ``user`` in DIRECTORY/USER.key: (that path, its public key)."""
    pair = Credentials.generate(user)
    assert pair.public_key is not None  # a generated pair has both halves
    path = os.path.join(directory, f"{user}.key")
    pair.write(path)
    return path, pair.public_key
