"""examples/secure_mesh: setup.sh makes a TLS mesh with users from nothing, two real
brokers start on what it made, and the client signs in, sends and is refused as the
user's permissions say."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

from tests.conftest import start_broker, stop_all

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "secure_mesh"


async def _run(*args: str, env: dict[str, str]) -> str:
    process = await asyncio.create_subprocess_exec(
        *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    return out.decode()


async def test_setup_then_two_brokers_then_the_client(tmp_path: Path) -> None:
    made = tmp_path / "mesh"
    meshbus_cli = f"{sys.executable} -m meshbus"
    printed = await _run("sh", str(EXAMPLE / "setup.sh"), str(made), env={"MESHBUS": meshbus_cli})
    assert f"made {made}:" in printed
    assert sorted(p.name for p in made.iterdir()) == [
        "a.broker.key", "b.broker.key", "brokers.toml", "game.creds", "mesh.toml", "tls",
        "users.toml",
    ]  # fmt: skip
    assert (made / "game.creds").stat().st_mode & 0o077 == 0
    config = ("--config", str(made / "mesh.toml"))
    a = await start_broker(*config, "--name", "a", "--broker-key", str(made / "a.broker.key"))
    b = await start_broker(
        *config, "--name", "b", "--broker-key", str(made / "b.broker.key"), "--seed", a.address
    )
    try:
        out = await _run(
            sys.executable,
            str(EXAMPLE / "client.py"),
            env={
                "MESHBUS_BROKER": f"{a.address},{b.address}",
                "MESHBUS_TLS_CA": str(made / "tls" / "ca.pem"),
                "MESHBUS_CREDS": str(made / "game.creds"),
            },
        )
    finally:
        assert await stop_all([a, b]) == [0, 0]
    lines = out.splitlines()
    assert re.fullmatch(r"signed in over TLS to broker [ab]", lines[0]), lines
    assert lines[1:] == [
        "received {'player': 'ann', 'score': 7}",
        "refused: permission denied: user 'game' may not subscribe to subject 'admin'"
        " (permissions.join)",
        "received {'player': 'bob', 'score': 9}",
    ]
