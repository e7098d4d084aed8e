"""Secure by default, with real broker processes: a broker told to listen on every
interface (0.0.0.0) without users refuses to start, unless --allow-anonymous (or
``allow-anonymous = true`` in its config) says so; with users it starts. Clients reach
them on 127.0.0.1, which 0.0.0.0 includes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import meshbus
from meshbus.auth import Credentials, users_entry
from tests.integration.helpers import launch_broker, start_broker_process


def _loopback(address: str) -> str:
    """The loopback address of a broker listening on 0.0.0.0:PORT."""
    return "127.0.0.1:" + address.rsplit(":", 1)[1]


async def test_every_interface_without_users_is_refused_with_what_to_do() -> None:
    process = await start_broker_process("--listen", "0.0.0.0:0")
    out, err = await asyncio.wait_for(process.communicate(), 20)
    stderr = err.decode()
    assert process.returncode == 1, stderr
    assert out == b""
    assert stderr.count("\n") == 1
    assert stderr.startswith("Error: refusing to listen on 0.0.0.0:0")
    assert "[[users]]" in stderr
    assert "docs/security.md" in stderr
    assert "--allow-anonymous" in stderr
    assert "Traceback" not in stderr


async def test_allow_anonymous_starts_it_open(tmp_path: Path) -> None:
    config = tmp_path / "broker.toml"
    config.write_text("allow-anonymous = true\n")
    for args in (("--allow-anonymous",), ("--config", str(config))):
        broker = await launch_broker(*args, listen="0.0.0.0:0")
        try:
            async with await meshbus.connect(_loopback(broker.address), server="anon") as conn:
                await conn.ping()
        finally:
            await broker.stop()


async def test_users_start_it_and_sign_in(tmp_path: Path) -> None:
    alice = Credentials.generate("alice")
    alice.write(tmp_path / "alice.creds")
    config = tmp_path / "broker.toml"
    config.write_text(users_entry("alice", public_key=alice.public_key, allow_all=True))
    broker = await launch_broker("--config", str(config), listen="0.0.0.0:0")
    try:
        address = _loopback(broker.address)
        async with await meshbus.connect(address, credentials=tmp_path / "alice.creds") as conn:
            await conn.ping()
    finally:
        await broker.stop()
