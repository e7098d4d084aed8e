"""Secure by default, with real broker processes: a broker told to listen on every
interface (0.0.0.0) without users refuses to start, unless --allow-anonymous (or
``allow-anonymous = true`` in its config) says so; with users it starts. Clients reach
them on 127.0.0.1, which 0.0.0.0 includes."""

from __future__ import annotations

import asyncio
import signal
import sys
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


async def test_mesh_up_on_every_interface_takes_a_config_file(tmp_path: Path) -> None:
    up = (sys.executable, "-m", "meshbus", "mesh", "up", "-n", "2", "--host", "0.0.0.0")
    pipes = {"stdout": asyncio.subprocess.PIPE, "stderr": asyncio.subprocess.PIPE}
    refused = await asyncio.create_subprocess_exec(*up, "--base-port", "0", **pipes)
    _, err = await asyncio.wait_for(refused.communicate(), 60)
    assert refused.returncode == 1
    assert "refusing to listen on 0.0.0.0:0 without users" in err.decode()

    config = tmp_path / "broker.toml"
    config.write_text("allow-anonymous = true\n")
    process = await asyncio.create_subprocess_exec(
        *up, "--base-port", "0", "--config", str(config), **pipes
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 60)).decode().strip()
        addresses = [_loopback(address) for address in line.split(",")]
        assert len(addresses) == 2, line
        async with await meshbus.connect(addresses[0], server="up") as conn:
            assert len((await conn.stat(detail=False))["peers"]) == 1
        process.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, err.decode()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
