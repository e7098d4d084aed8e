"""Replicated streams whose Raft logs are compacted (docs/raft.md, "Snapshots of a
stream"), on three real brokers with a small threshold (--raft-compact-entries 64): a
follower cut off while thousands of appends are acknowledged and the logs compacted
past it catches up by a snapshot -- it copies the stream from the leader -- and holds
exactly what the others hold; a follower whose data dir was wiped is rebuilt from a
compacted leader the same way; and under a long run of appends every replica's log,
in memory and on disk, stays bounded."""

from __future__ import annotations

import asyncio
import shutil
import time
from typing import Any

import pytest

import meshbus
from meshbus import ReliableConfig
from tests.conftest import BrokerProcess
from tests.integration.helpers import stat, wait_until
from tests.integration.test_replicated_faults import FAST, RETRY, followers, rebuilt
from tests.integration.test_replicated_streams import (
    STREAM,
    Consumer,
    Producer,
    check_copies,
    replicated_stream,
)

pytestmark = pytest.mark.slow

ENTRIES = 64
COMPACT = ("--raft-compact-entries", str(ENTRIES), "--raft-compact-bytes", "65536")
ARGS = (*FAST, *COMPACT)
# Entries a replica may hold since its snapshot: twice the threshold while a follower
# that answers lacks them, and a turn's more.
MAX_HELD = 2 * ENTRIES + 32


async def raft_of(broker: BrokerProcess) -> dict[str, Any]:
    """What stat shows of the broker's replicated streams (ReplicatedStreams.observe)."""
    raft: dict[str, Any] = (await stat(broker))["streams"]["raft"]
    return raft


async def producing(replicas: Any, broker: str, count: int) -> list[Producer]:
    """``count`` producers of unique values on ``broker``, each with 5 acknowledged."""
    producers = [await Producer.on(replicas[broker], f"p{i}-", RETRY) for i in range(count)]
    for producer in producers:
        await producer.wait_acked(5)
    return producers


async def acknowledged(producers: list[Producer], each: int, since: float) -> None:
    for producer in producers:
        await producer.wait_acked(each, since=since, timeout=90)


@pytest.mark.parametrize("nemesis", ["cut", "pause"])
async def test_a_follower_left_behind_the_compacted_log_catches_up_by_a_snapshot(
    tmp_path, nemesis: str
) -> None:
    """The follower cut off (its links through the gates) or paused (SIGSTOP: its links
    stay open, and what was sent to it before the leader stopped hearing from it waits
    in them)."""
    async with replicated_stream(tmp_path, *ARGS) as (replicas, info):
        leader = info.leader
        cut, other = followers(replicas, leader)
        producers = await producing(replicas, leader, 4)
        consumer = await Consumer.on(replicas[other])
        cut_at = time.monotonic()
        if nemesis == "cut":
            replicas.cut_off(cut)
        else:
            replicas.pause(cut)
        await acknowledged(producers, 600, since=cut_at)  # 2,400 appends without it
        seen = await raft_of(replicas[leader])
        held = seen["streams"][STREAM]
        # A turn's captures are one entry: 2,400 appends are at least 600 entries.
        assert seen["compactions"] >= 600 // (2 * ENTRIES), seen
        assert held["log_entries"] <= MAX_HELD, held
        if nemesis == "cut":
            behind = (await raft_of(replicas[cut]))["streams"][STREAM]
            assert behind["snapshot"] < held["snapshot"]  # what it lacks is gone
            replicas.reconnect(cut)
        else:
            replicas.resume(cut)
        healed_at = time.monotonic()

        async def installed() -> bool:
            return (await raft_of(replicas[cut]))["snapshots_installed"] >= 1

        await wait_until(installed, f"{cut} installing a snapshot", timeout=30)
        await acknowledged(producers, 20, since=healed_at)
        for producer in producers:
            await producer.stop()
        copies = await check_copies(replicas, producers, consumer)  # fetched from each
        await consumer.stop()
        assert len(copies) >= 2400
        seen = await raft_of(replicas[cut])
        assert seen["copied_blocks"] > 0, seen
        # From the leader -- or, if one was elected meanwhile (a loaded machine), from it.
        served = [(await raft_of(replicas[name]))["served_blocks"] for name in (leader, other)]
        assert sum(served) >= seen["copied_blocks"], (served, seen)


async def test_a_wiped_follower_is_rebuilt_from_a_compacted_leader(tmp_path) -> None:
    async with replicated_stream(tmp_path, *ARGS) as (replicas, info):
        leader = info.leader
        wiped, _ = followers(replicas, leader)
        producers = await producing(replicas, leader, 4)
        consumer = await Consumer.on(replicas[leader])
        await replicas.kill(wiped)
        shutil.rmtree(replicas.data_dir(wiped))
        await acknowledged(producers, 300, since=time.monotonic())
        held = (await raft_of(replicas[leader]))["streams"][STREAM]
        assert held["snapshot"] > 0, held  # its log no longer starts at entry 1
        await replicas.restart(wiped)
        async with await meshbus.connect(replicas[leader].address, server="c") as conn:
            await rebuilt(conn, sorted(replicas.names), "the wiped follower a voter again")
        seen = await raft_of(replicas[wiped])
        assert seen["snapshots_installed"] >= 1, seen
        assert seen["copied_blocks"] > 0, seen
        await acknowledged(producers, 10, since=time.monotonic())
        for producer in producers:
            await producer.stop()
        await check_copies(replicas, producers, consumer)
        await consumer.stop()


async def test_the_raft_log_stays_bounded_under_a_long_run_of_appends(tmp_path) -> None:
    """4 MB of appends (1 KiB each) on a stream whose replicas compact every 64 entries
    or 64 KiB: the log file of each is rewritten once past 512 KiB (8 times the bytes
    threshold) and twice its live records, and holds far less than was written; the
    log in memory, far less than was appended."""
    async with replicated_stream(tmp_path, *ARGS) as (replicas, info):
        leader = info.leader
        payload = bytes(1024)
        async with await meshbus.connect(
            replicas[leader].address, server="bulk", reliable=ReliableConfig(retry=RETRY)
        ) as conn:
            sender = await conn.register()
            sent = 0

            async def send(count: int) -> None:
                nonlocal sent
                for _ in range(count):
                    await sender.send_reliable(f"multicast:{STREAM}", payload)
                    sent += 1

            async with asyncio.TaskGroup() as tasks:
                for _ in range(16):
                    tasks.create_task(send(256))
        assert sent == 4096
        for name in replicas.names:
            size = (replicas.data_dir(name) / "raft.wal").stat().st_size
            # 4 MB written, and more with overhead; a rewrite comes at the end of a turn,
            # and a turn on a loaded host may write several hundred KiB past 512 KiB.
            assert size < 2 << 20, (name, size)
            held = (await raft_of(replicas[name]))["streams"][STREAM]
            assert held["log_entries"] <= MAX_HELD, (name, held)
