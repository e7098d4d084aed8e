"""Shared fixtures: real broker processes on loopback, started on port 0."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from meshbus.broker.process import spawn_broker


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
    process, name, address = await spawn_broker(*args)
    return BrokerProcess(process, name, address)


@pytest.fixture
async def broker() -> AsyncIterator[BrokerProcess]:
    proc = await start_broker()
    try:
        yield proc
    finally:
        code = await proc.stop()
        assert code == 0, f"broker exited with {code} on SIGTERM"
