"""A stream host whose disk fills (its data dir on a tmpfs of its own, filled by a
ballast file): appends are refused -- never acknowledged -- while the broker goes on
routing, and once there is room again they are stored and acknowledged, with every
message acknowledged before still there. (A replicated stream's leader on a full disk:
test_replicated_faults.py.)"""

from __future__ import annotations

import meshbus
from meshbus import ReliableConfig, RetryPolicy
from meshbus.errors import DeliveryFailed
from tests.conftest import start_broker, stop_all
from tests.integration.helpers import disks_of_their_own, fill
from tests.integration.test_streams import fetch_all

# A send is resent for about 1.5 s, then given up.
RETRY = RetryPolicy(ack_timeout=0.2, max_interval=0.4, max_attempts=5)


async def refused_once_full(publisher: meshbus.Service) -> None:
    for i in range(20000):
        try:
            await publisher.send_reliable("multicast:ledger", b"full-%d|" % i + b"x" * 1000)
        except DeliveryFailed:
            return
    raise AssertionError("20,000 appends of 1 KiB acknowledged on a full 64 MiB disk")


async def test_a_full_disk_refuses_appends_until_there_is_room(tmp_path) -> None:
    with disks_of_their_own(tmp_path, ["host"], size="64m"):
        host = await start_broker("--data-dir", str(tmp_path / "host"))
        try:
            async with await meshbus.connect(
                host.address, server="pub", reliable=ReliableConfig(retry=RETRY)
            ) as conn:
                await conn.streams.add("ledger", "multicast:ledger")
                publisher = await conn.register()
                echo = await conn.register()
                before = [b"before-%d|" % i + b"x" * 1000 for i in range(200)]
                for payload in before:
                    await publisher.send_reliable("multicast:ledger", payload)
                ballast = fill(tmp_path / "host")
                # SQLite's WAL takes appends in the room it already has until it must grow.
                await refused_once_full(publisher)
                # The broker itself goes on: a unicast through it is delivered.
                await publisher.send_reliable(echo.address, b"still routing")
                assert (await echo.recv(timeout=5)).payload == b"still routing"
                ballast.unlink()
                await publisher.send_reliable("multicast:ledger", b"after")
                stored = [m.payload for m in await fetch_all(conn, "ledger")]
                assert stored[: len(before)] == before
                assert stored[-1] == b"after"
                assert len(stored) == len(set(stored)), "a message stored twice"
                assert all(p.startswith(b"full-") for p in stored[len(before) : -1])
        finally:
            assert await stop_all([host]) == [0]
