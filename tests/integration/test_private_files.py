"""A broker refuses secrets that other users may read (docs/security.md, "Files that hold
secrets"): its key, its TLS key, a config file of token hashes; a config file of users
that others may change. ``--allow-insecure-key-files`` starts it anyway."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import trustme

from meshbus.auth import TokenKey, users_entry
from meshbus.private_files import write_private
from tests.integration.helpers import broker_key, launch_broker, start_broker_process


def _tls_files(directory: Path) -> tuple[Path, Path]:
    leaf = trustme.CA().issue_cert("127.0.0.1")
    cert, key = directory / "b.crt", directory / "b.key"
    leaf.cert_chain_pems[0].write_to_path(str(cert))
    write_private(key, leaf.private_key_pem.bytes())
    return cert, key


def _scene(directory: Path, secret: str) -> tuple[Path, list[str]]:
    """The broker's arguments, and the file among them that holds ``secret``."""
    if secret == "tls-key":
        cert, key = _tls_files(directory)
        return key, ["--tls-cert", str(cert), "--tls-key", str(key)]
    key_pair = broker_key(directory, "b1")
    config = directory / "broker.toml"
    text = key_pair.settings + key_pair.entry
    if secret == "token-hashes":
        text += users_entry("bob", token_hash=str(TokenKey.of("bob", "bobs-token")))
    write_private(config, text.encode())
    if secret == "broker-key":
        return key_pair.path, ["--config", str(config)]
    return config, ["--config", str(config)]


@pytest.mark.parametrize(
    ("secret", "mode"),
    [
        ("tls-key", 0o644),
        ("broker-key", 0o640),
        ("token-hashes", 0o604),
        ("users", 0o664),  # others may change who signs in
    ],
)
async def test_a_secret_others_may_read_stops_the_broker_unless_allowed(
    tmp_path: Path, secret: str, mode: int
) -> None:
    path, args = _scene(tmp_path, secret)
    path.chmod(mode)
    process = await start_broker_process("--listen", "127.0.0.1:0", *args)
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 1
    assert out == b""
    (line,) = err.decode().strip().splitlines()
    assert str(path) in line
    assert f"(mode {mode:04o})" in line
    assert f"chmod 600 {path}" in line
    assert "--allow-insecure-key-files" in line

    broker = await launch_broker(*args, "--allow-insecure-key-files")
    assert await broker.stop() == 0


async def test_a_config_of_public_keys_may_be_read_by_others(tmp_path: Path) -> None:
    """Public keys are no secret: only changing the file is kept from others."""
    config, args = _scene(tmp_path, "users")
    config.chmod(0o644)
    broker = await launch_broker(*args)
    assert await broker.stop() == 0
