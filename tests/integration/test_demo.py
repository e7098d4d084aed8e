"""``python -m meshbus.demo`` runs its whole scenario and exits 0."""

from __future__ import annotations

import asyncio
import sys


async def test_demo_runs_and_passes() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "meshbus.demo",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out_bytes, err_bytes = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    out, err = out_bytes.decode(), err_bytes.decode()
    assert process.returncode == 0, out + err
    assert "Traceback" not in err
    for expected in (
        "broker mesh-1 listening on 127.0.0.1:",
        "broker mesh-3 listening on 127.0.0.1:",
        "multicast:chat.lobby",
        "taken by lobby01:",
        "room 1 says: who is here?",
        "NoRoute after",
        "Timeout after",
        "counters",
        "kill -9 mesh-2",
        "same addresses after failover",
        "mesh-4 joined",
        "SIGTERM mesh-3: it drained",
        "stopped with SIGTERM (exit 0)",
        "demo passed",
    ):
        assert expected in out, f"{expected!r} missing from the demo output:\n{out}"
    assert "FAILED" not in out
