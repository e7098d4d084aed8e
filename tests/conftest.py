"""Shared fixtures: real broker processes on loopback, started on port 0."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

READY_PREFIX = "meshbus broker "


@dataclass
class BrokerProcess:
    process: asyncio.subprocess.Process
    name: str
    address: str

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    async def stop(self) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.process.wait(), 10)


async def start_broker(*args: str) -> BrokerProcess:
    """Start `meshbus broker --listen 127.0.0.1:0 ARGS` and wait for its ready line."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "meshbus",
        "broker",
        "--listen",
        "127.0.0.1:0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    line = (await asyncio.wait_for(process.stdout.readline(), 20)).decode()
    if not line.startswith(READY_PREFIX):
        process.kill()
        await process.wait()
        raise RuntimeError(f"broker did not print its ready line, got {line!r}")
    # "meshbus broker NAME listening on HOST:PORT"
    words = line.split()
    return BrokerProcess(process, words[2], words[-1])


@pytest.fixture
async def broker() -> AsyncIterator[BrokerProcess]:
    proc = await start_broker()
    try:
        yield proc
    finally:
        code = await proc.stop()
        assert code == 0, f"broker exited with {code} on SIGTERM"
