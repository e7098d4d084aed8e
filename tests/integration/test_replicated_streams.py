"""Replicated streams (--replicas 3) on three real broker processes, each with its own
--data-dir: the leader killed with kill -9 while a producer sends reliably, and a
stream that lost a majority of its replicas refusing to acknowledge."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

import meshbus
from meshbus import Multicast, ReliableConfig, RetryPolicy
from meshbus.client.streams import StreamInfo
from meshbus.errors import DeliveryFailed, StreamError
from tests.conftest import BrokerProcess, start_broker, stop_all
from tests.integration.helpers import wait_members, wait_until
from tests.integration.test_cli import run_cli
from tests.integration.test_streams import fetch_all

# Election timeouts are 1-2 s (meshbus.broker.streams.RAFT_TICK, RAFT_SETTINGS); a
# leader's death is noticed after one, so appends resume within a few.
RESUME_WITHIN = 10.0


async def replicated_mesh(tmp_path: Path) -> list[BrokerProcess]:
    """Three brokers, r0..r2, each with its data dir (tmp_path/r0...): a replica is known
    to its group by its name, so one that restarts keeps it (``restart``)."""
    first = await start_broker("--name", "r0", "--data-dir", str(tmp_path / "r0"))
    rest = [await restart(tmp_path, f"r{i}", first) for i in (1, 2)]
    return [first, *rest]


async def restart(tmp_path: Path, name: str, seed: BrokerProcess) -> BrokerProcess:
    return await start_broker(
        "--name", name, "--data-dir", str(tmp_path / name), "--seed", seed.address
    )


async def led(conn: meshbus.Connector, stream: str, not_by: str = "") -> StreamInfo:
    """The stream's info once a leader (other than ``not_by``) is elected."""
    info: StreamInfo | None = None

    async def has_leader() -> bool:
        nonlocal info
        info = await conn.streams.info(stream)
        return info.leader not in ("", not_by)

    await wait_until(has_leader, f"a leader of stream {stream}", timeout=20)
    assert info is not None
    return info


async def test_the_leader_killed_loses_no_acknowledged_message(tmp_path: Path) -> None:
    brokers = await replicated_mesh(tmp_path)
    by_name = {b.name: b for b in brokers}
    try:
        added = await run_cli(
            "stream", "add", "ledger", "--capture", "multicast:ledger", "--replicas", "3",
            "--broker", brokers[0].address, "--json",
        )  # fmt: skip
        assert added.code == 0, added.err
        assert sorted(json.loads(added.out)["replicas"]) == sorted(by_name)
        async with await meshbus.connect(brokers[0].address, server="op", operator=True) as op:
            info = await led(op, "ledger")
        assert sorted(info.replicas) == sorted(by_name)
        shown = await run_cli("stream", "info", "ledger", "--broker", brokers[1].address)
        assert shown.code == 0, shown.err
        assert re.search(rf"leader\s+│?\s*{info.leader}", shown.out), shown.out
        assert all(name in shown.out for name in by_name)
        await wait_members(brokers, Multicast("ledger"), 1)
        leader = by_name[info.leader]
        survivor = next(b for b in brokers if b is not leader)
        acked: list[int] = []
        failed: list[int] = []
        async with await meshbus.connect(survivor.address, server="pub") as conn:
            publisher = await conn.register()
            # Plain sends first: no publish id, so only the applied index keeps a replica
            # that restarts from applying them twice. (At most once: one sent while the
            # leadership moves may be lost, so only some are waited for.)
            for i in range(20):
                await publisher.send("multicast:ledger", b"plain-%d" % i)

            async def plain_stored() -> bool:
                return len(await fetch_all(conn, "ledger")) > 0

            await wait_until(plain_stored, "the plain sends stored")
            killed_at = 0.0
            resumed_at = 0.0
            for value in range(300):
                if value == 100:
                    leader.process.kill()
                    assert await leader.process.wait() == -9
                    killed_at = time.monotonic()
                try:
                    await publisher.send_reliable("multicast:ledger", b"v%d" % value)
                except DeliveryFailed:
                    failed.append(value)
                    continue
                acked.append(value)
                if killed_at and not resumed_at:
                    resumed_at = time.monotonic()
            assert resumed_at - killed_at < RESUME_WITHIN, (killed_at, resumed_at)
            assert len(acked) == 300, failed  # the resends carried every one through
            new = await led(conn, "ledger", not_by=leader.name)
            assert sorted(new.replicas) == sorted(by_name)
        # Read through the new leader: its committed prefix has every acknowledged value.
        async with await meshbus.connect(by_name[new.leader].address, server="reader") as conn:
            stored = await fetch_all(conn, "ledger")
        assert stored[0].payload.startswith(b"plain-")
        values = [int(m.payload[1:]) for m in stored if m.payload.startswith(b"v")]
        assert len(values) == len(set(values)), "a value stored twice"
        assert [v for v in values if v in set(acked)] == acked  # all there, in order
        assert [m.seq for m in stored] == list(range(1, len(stored) + 1))
        # The other survivor serves its committed prefix: the same, once it caught up.
        other = next(b for b in brokers if b.name not in (leader.name, new.leader))
        async with await meshbus.connect(other.address, server="reader") as conn:
            # A current read asked of this follower is answered by the leader.
            current = await conn.streams.fetch("ledger", len(stored), 10, current=True)
            assert [m.payload for m in current] == [stored[-1].payload]

            async def caught_up() -> bool:
                return len(await fetch_all(conn, "ledger")) == len(stored)

            await wait_until(caught_up, "the other survivor's copy")
            copy = await fetch_all(conn, "ledger")
        assert [(m.seq, m.payload) for m in copy] == [(m.seq, m.payload) for m in stored]
        # The old leader back from its data dir: what it applied before is not applied
        # twice (its store records the last entry applied), and it catches up.
        brokers[brokers.index(leader)] = back = await restart(tmp_path, leader.name, survivor)
        async with await meshbus.connect(back.address, server="reader") as conn:

            async def back_in_step() -> bool:
                info = await conn.streams.info("ledger")
                return info.last_seq == len(stored) and info.leader == new.leader

            await wait_until(back_in_step, "the restarted broker's copy", timeout=20)
            copy = await fetch_all(conn, "ledger")
            assert [(m.seq, m.payload) for m in copy] == [(m.seq, m.payload) for m in stored]
            # A delete asked of a follower goes to the leader; every replica deletes the
            # stream once the deletion is committed.
            await conn.streams.delete("ledger")

            async def gone_everywhere() -> bool:
                for broker in brokers:
                    async with await meshbus.connect(broker.address, server="check") as c:
                        try:
                            await c.streams.info("ledger")
                        except StreamError:
                            continue
                        return False
                return True

            await wait_until(gone_everywhere, "the stream deleted on every replica")
    finally:
        await stop_all([b for b in brokers if b.process.returncode is None])


async def test_a_minority_acknowledges_nothing(tmp_path: Path) -> None:
    brokers = await replicated_mesh(tmp_path)
    try:
        async with await meshbus.connect(brokers[0].address, server="op", operator=True) as op:
            await op.streams.add("ledger", "multicast:ledger", replicas=3)
            await led(op, "ledger")
        await wait_members(brokers, Multicast("ledger"), 1)
        survivor, *doomed = brokers
        for broker in doomed:
            broker.process.kill()
            await broker.process.wait()
        retry = RetryPolicy(ack_timeout=0.5, max_attempts=5)
        async with await meshbus.connect(
            survivor.address, server="pub", reliable=ReliableConfig(retry=retry)
        ) as conn:
            publisher = await conn.register()
            # Never acknowledged: a replica without a majority cannot commit it.
            with pytest.raises(DeliveryFailed, match="no acknowledgement"):
                await publisher.send_reliable("multicast:ledger", b"unacked")
            info = await conn.streams.info("ledger")
            assert info.leader == ""  # the last one stepped down: no majority answers it
            assert [m.payload for m in await fetch_all(conn, "ledger")] == []
    finally:
        await stop_all([b for b in brokers if b.process.returncode is None])
