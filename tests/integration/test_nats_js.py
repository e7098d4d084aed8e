"""nats.js -- the NATS project's Node.js client, pinned in tests/nats_js/package-lock.json
and installed by ``make test`` (``make nats-js``) -- against a broker's NATS listener:
wildcards, queue groups, headers, request/reply, no responders, sign-in with a
password, a token and an nkey, and TLS. Each test runs tests/nats_js/client.mjs for one
check; node and the package must be there (``make nats-js`` installs both)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshbus.auth import Credentials, TokenKey, users_entry
from meshbus.private_files import write_private
from tests.integration.test_nats_listener import start_meshbus, stop

HERE = Path(__file__).parent.parent / "nats_js"
NODE = shutil.which("node") or "node"
TOKEN = "js-token"


def run(check: str, options: dict[str, object]) -> None:
    """client.mjs CHECK with nats.js's connect ``options``; fails with its output."""
    import json

    assert (HERE / "node_modules" / "nats").is_dir(), "run make nats-js (npm ci in tests/nats_js)"
    done = subprocess.run(
        [NODE, str(HERE / "client.mjs"), check, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"ok {check}"


@pytest.fixture(scope="module")
def open_broker() -> Iterator[int]:
    process, port = start_meshbus()
    try:
        yield port
    finally:
        stop(process)


@pytest.mark.parametrize("check", ["wildcards", "queues", "headers", "requests", "noResponders"])
def test_core_nats(open_broker: int, check: str) -> None:
    run(check, {"servers": f"127.0.0.1:{open_broker}"})


@pytest.fixture(scope="module")
def alice_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture(scope="module")
def tls_and_users(
    tmp_path_factory: pytest.TempPathFactory, alice_key: Ed25519PrivateKey
) -> Iterator[tuple[int, Path]]:
    """A broker with TLS (a trustme CA's certificate for 127.0.0.1) and two users: bob
    with a token, alice with a key pair. (port, CA file)."""
    directory = tmp_path_factory.mktemp("nats-js")
    ca = trustme.CA()
    ca_file, cert, key = (directory / name for name in ("ca.pem", "b.crt", "b.key"))
    ca.cert_pem.write_to_path(str(ca_file))
    # Node checks a certificate's DNS names even for an IP address dialled (nats.js gives
    # the host as the TLS server name): the certificate names localhost, dialled as such.
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    write_private(key, leaf.private_key_pem.bytes())
    alice = Credentials("alice", private_key=alice_key)
    config = directory / "broker.toml"
    text = users_entry("alice", public_key=alice.public_key, allow_all=True) + "\n"
    text += users_entry("bob", token_hash=str(TokenKey.of("bob", TOKEN)), allow_all=True)
    write_private(config, text.encode())
    process, port = start_meshbus(
        "--config", str(config), "--tls-cert", str(cert), "--tls-key", str(key)
    )
    try:
        yield port, ca_file
    finally:
        stop(process)


def test_user_and_password_over_tls(tls_and_users: tuple[int, Path]) -> None:
    port, ca = tls_and_users
    run("tls", {"servers": f"localhost:{port}", "ca": str(ca), "user": "bob", "pass": TOKEN})


def test_a_token_over_tls(tls_and_users: tuple[int, Path]) -> None:
    port, ca = tls_and_users
    run("signedIn", {"servers": f"localhost:{port}", "ca": str(ca), "token": f"bob:{TOKEN}"})


def test_an_nkey_over_tls(tls_and_users: tuple[int, Path], alice_key: Ed25519PrivateKey) -> None:
    port, ca = tls_and_users
    seed = Credentials("alice", private_key=alice_key).nkey_seed
    run("signedIn", {"servers": f"localhost:{port}", "ca": str(ca), "seed": seed})


def test_a_wrong_password_is_refused(tls_and_users: tuple[int, Path]) -> None:
    port, ca = tls_and_users
    run("refused", {"servers": f"localhost:{port}", "ca": str(ca), "user": "bob", "pass": "no"})
