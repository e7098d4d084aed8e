"""Real brokers, real faults (issue 27, "How it is proven", part 2): a stream of three
replicas under a producer of unique values and a consumer, through one nemesis per
test -- the leader paused past its election timeout, the leader cut off from the
followers while its clients still reach it, a majority killed and restarted, a
follower's data dir wiped (it comes back as a new replica), a follower lost for good
(another broker takes its place), a bit flipped in a follower's Raft log, the leader's
disk full, a broker cut off from every replica. After each: no
acknowledged value lost, none stored twice, the order kept, the copies equal
(``check_copies``); appends acknowledged again within a few election timeouts while a
majority is up, and never acknowledged while only a minority is.

The brokers tick Raft every 40 ms (--raft-tick): election timeouts of 0.4-0.8 s."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import struct
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

import meshbus
from meshbus import RetryPolicy
from meshbus.errors import MeshbusError
from meshbus.storage.raftlog import MAGIC, WalRecord
from tests.integration.helpers import disks_of_their_own, fill, wait_until
from tests.integration.test_replicated_streams import (
    NO_MEMBER,
    STREAM,
    Consumer,
    Producer,
    Replicas,
    check_copies,
    replicated_stream,
)

pytestmark = pytest.mark.slow

RAFT_TICK = 0.04
ELECTION = 20 * RAFT_TICK  # the longest election timeout
FAST = ("--raft-tick", str(RAFT_TICK), "--heartbeat-interval", "0.2")
# "Within a few election timeouts", with the client's resend interval on top.
RESUME_WITHIN = 6 * ELECTION
# A value is resent for 2.6 s, then given up ("no acknowledgement").
RETRY = RetryPolicy(ack_timeout=0.2, max_interval=0.5, max_attempts=6)


def followers(replicas: Replicas, leader: str) -> list[str]:
    return [n for n in replicas.names if n != leader]


async def leader_seen_by(broker: meshbus.Connector) -> str:
    return (await broker.streams.info(STREAM)).leader


async def led_by_another(broker: meshbus.Connector, old: str, what: str, timeout: float) -> None:
    """Until ``broker`` knows a leader of the stream other than ``old``."""

    async def another() -> bool:
        return (await leader_seen_by(broker)) not in ("", old)

    await wait_until(another, what, timeout=timeout)


async def on_both_sides(replicas: Replicas, leader: str) -> tuple[Producer, Producer, Consumer]:
    """A producer on a follower, one on the leader (its clients keep it, and still reach
    it when it is cut off from the others), each with 20 values acknowledged; and a
    consumer on the follower."""
    follower = followers(replicas, leader)[0]
    outside = await Producer.on(replicas[follower], "f", RETRY)
    inside = await Producer.on(replicas[leader], "l", RETRY)
    consumer = await Consumer.on(replicas[follower])
    await outside.wait_acked(20)
    await inside.wait_acked(20)
    return outside, inside, consumer


async def stopped_and_checked(
    replicas: Replicas, producers: list[Producer], consumer: Consumer
) -> None:
    """The producers stopped, then every copy checked against what they were acknowledged
    and what ``consumer`` read (``check_copies``), then the consumer stopped."""
    for producer in producers:
        await producer.stop()
    await check_copies(replicas, producers, consumer)
    await consumer.stop()


async def refused_meanwhile(producer: Producer, since: float) -> None:
    """Nothing acknowledged after ``since`` (an election timeout past the fault: what was
    committed before it may be acknowledged a moment after) until a send was given up
    with an error a sender sees: no acknowledgement, or (its broker lost every replica
    that held the stream's address) its group refused for having no member now."""
    given_up = len(producer.failed)

    async def gave_up() -> bool:
        acked = producer.acked_since(since)
        assert acked == 0, f"{acked} acknowledged without a majority, none given up"
        return len(producer.failed) > given_up

    what = f"a send given up (last given up: {producer.failed[-1:]})"
    await wait_until(gave_up, what, timeout=4 * RETRY.give_up_after())
    said = producer.failed[-1][1]
    refusals = ("no acknowledgement", "the stream that captures it was on broker")
    assert any(r in said for r in refusals) or said == NO_MEMBER, producer.failed[-1]
    assert producer.acked_since(since) == 0, "acknowledged without a majority"


async def test_a_paused_leader_steps_down_and_acknowledges_nothing_alone(tmp_path) -> None:
    async with replicated_stream(tmp_path, *FAST) as (replicas, info):
        leader = info.leader
        outside, inside, consumer = await on_both_sides(replicas, leader)
        paused_at = time.monotonic()
        replicas.pause(leader)
        assert await outside.wait_acked(10, since=paused_at) < RESUME_WITHIN
        await asyncio.sleep(paused_at + 3 * ELECTION - time.monotonic())
        # Stopped, it acknowledged nothing; once going again, it finds a later term,
        # steps down, and what it captured in its old term is not acknowledged by it.
        assert inside.acked_since(paused_at + RAFT_TICK) == 0
        replicas.resume(leader)
        resumed_at = time.monotonic()
        async with await meshbus.connect(replicas[leader].address, server="c") as conn:
            await led_by_another(conn, leader, "the old leader following the new one", 10)
        await inside.wait_acked(10, since=resumed_at)
        await stopped_and_checked(replicas, [outside, inside], consumer)


async def test_a_leader_cut_off_from_its_followers_acknowledges_nothing(tmp_path) -> None:
    async with replicated_stream(tmp_path, *FAST) as (replicas, info):
        leader = info.leader
        outside, inside, consumer = await on_both_sides(replicas, leader)
        cut_at = time.monotonic()
        replicas.cut_off(leader)
        assert await outside.wait_acked(10, since=cut_at) < RESUME_WITHIN
        await refused_meanwhile(inside, since=cut_at + ELECTION)
        async with await meshbus.connect(replicas[leader].address, server="c") as conn:
            assert await leader_seen_by(conn) == ""  # check-quorum: it stepped down
        replicas.reconnect(leader)
        healed_at = time.monotonic()
        assert await inside.wait_acked(10, since=healed_at) < RESUME_WITHIN
        await stopped_and_checked(replicas, [outside, inside], consumer)


async def test_a_broker_cut_off_from_every_replica_refuses_its_clients_appends(
    tmp_path,
) -> None:
    """A fourth broker holds no replica. Cut off from the three, it knows no member of
    the stream's group; its clients' sends are refused (Timeout: the stream that captures
    it is out of reach), never taken for a multicast to nobody -- which returned 0, "sent",
    and stored nothing."""
    async with replicated_stream(tmp_path, *FAST, brokers=4) as (replicas, info):
        (outsider,) = [n for n in replicas.names if n not in info.replicas]
        producer = await Producer.on(replicas[outsider], "o", RETRY)
        consumer = await Consumer.on(replicas[info.leader])
        await producer.wait_acked(20)
        cut_at = time.monotonic()
        replicas.cut_off(outsider)
        await refused_meanwhile(producer, since=cut_at + ELECTION)
        assert NO_MEMBER not in {said for _, said in producer.failed}, producer.failed
        replicas.reconnect(outsider)
        healed_at = time.monotonic()
        await producer.wait_acked(10, since=healed_at)
        await stopped_and_checked(replicas, [producer], consumer)


async def test_a_majority_killed_then_restarted_loses_nothing(tmp_path) -> None:
    async with replicated_stream(tmp_path, *FAST) as (replicas, info):
        survivor, *doomed = followers(replicas, info.leader)
        doomed.append(info.leader)
        producer = await Producer.on(replicas[survivor], "v", RETRY)
        consumer = await Consumer.on(replicas[survivor])
        await producer.wait_acked(30)
        killed_at = time.monotonic()
        await replicas.kill(*doomed)
        await refused_meanwhile(producer, since=killed_at + ELECTION)
        for name in doomed:
            await replicas.restart(name)
        restarted_at = time.monotonic()
        assert await producer.wait_acked(10, since=restarted_at) < RESUME_WITHIN
        await stopped_and_checked(replicas, [producer], consumer)


async def rebuilt(broker: meshbus.Connector, voters: list[str], what: str) -> None:
    """Until the leader ``broker`` reaches has ``voters`` (sorted) for voters, no learner,
    and every one of them holds its log but the last few entries."""

    async def done() -> bool:
        try:
            info = await broker.streams.info(STREAM, current=True)
        except MeshbusError:
            return False  # no leader for a moment
        caught_up = all(r["lag"] <= 8 for r in info.replica_states)
        return sorted(info.replicas) == voters and not info.learners and caught_up

    await wait_until(done, what, timeout=30)


async def test_a_follower_with_its_data_dir_wiped_is_rebuilt_as_a_new_replica(tmp_path) -> None:
    """Back with its data dir wiped, a follower is a new incarnation: it lost what it
    acknowledged and its votes, so it does not count as its old self. The leader adds it
    as a new member -- a learner that copies the whole log --, removes the old one and
    promotes it; then it counts: with the other follower killed, the leader and it are
    a majority and appends are acknowledged."""
    async with replicated_stream(tmp_path, *FAST) as (replicas, info):
        leader = info.leader
        wiped, other = followers(replicas, leader)
        producer = await Producer.on(replicas[leader], "v", RETRY)
        consumer = await Consumer.on(replicas[leader])
        await producer.wait_acked(20)
        await replicas.kill(wiped)
        shutil.rmtree(replicas.data_dir(wiped))
        await producer.wait_acked(20, since=time.monotonic())
        await replicas.restart(wiped)
        async with await meshbus.connect(replicas[leader].address, server="c") as conn:
            await rebuilt(conn, sorted(replicas.names), "the wiped follower a voter again")
        await producer.wait_acked(10, since=time.monotonic())
        killed_at = time.monotonic()
        await replicas.kill(other)
        assert await producer.wait_acked(10, since=killed_at) < RESUME_WITHIN
        await stopped_and_checked(replicas, [producer], consumer)


async def test_a_replica_lost_for_good_is_replaced_by_the_next_broker(tmp_path) -> None:
    """A fourth broker in the mesh, --replace-after 2: a follower killed for good is
    replaced by it (the next in the stream's placement order) once silent for 2 s; it
    copies the log and becomes a voter, so with one more original killed the leader and
    it are a majority and appends are acknowledged."""
    args = (*FAST, "--replace-after", "2")
    async with replicated_stream(tmp_path, *args, brokers=4) as (replicas, info):
        leader = info.leader
        spare = next(n for n in replicas.names if n not in info.replicas)
        gone, other = (n for n in info.replicas if n != leader)
        producer = await Producer.on(replicas[leader], "v", RETRY)
        consumer = await Consumer.on(replicas[leader])
        await producer.wait_acked(20)
        await replicas.kill(gone)
        async with await meshbus.connect(replicas[leader].address, server="c") as conn:
            await rebuilt(conn, sorted({leader, other, spare}), f"{spare} a voter for {gone}")
        await producer.wait_acked(10, since=time.monotonic())
        killed_at = time.monotonic()
        await replicas.kill(other)
        assert await producer.wait_acked(10, since=killed_at) < RESUME_WITHIN
        await stopped_and_checked(replicas, [producer], consumer)


def record_holding(data: bytes, holding: bytes) -> tuple[int, int]:
    """Where the first record of a Raft log (its bytes ``data``) whose payload holds
    ``holding`` starts, and where its payload starts (the records: raftlog.py's
    docstring)."""
    header = struct.Struct("<II")
    pos = len(MAGIC)
    while pos < len(data):
        length, _ = header.unpack_from(data, pos)
        start = pos + header.size
        payload = bytes(data[start : start + length])
        msgspec.msgpack.decode(payload, type=WalRecord)  # intact so far
        if holding in payload:
            return pos, start + payload.index(holding)
        pos = start + length
    raise AssertionError(f"no record holds {holding!r}")


def flip_a_bit(wal: Path, holding: bytes) -> None:
    """Flip one bit of ``holding`` in the first record of Raft log ``wal`` holding it."""
    data = bytearray(wal.read_bytes())
    data[record_holding(data, holding)[1]] ^= 0x08
    wal.write_bytes(data)


def cut_short(wal: Path, holding: bytes) -> None:
    """Truncate Raft log ``wal`` at the start of the first record holding ``holding``:
    it and every record after it gone, synced as they were -- a clean end to read."""
    record, _ = record_holding(wal.read_bytes(), holding)
    os.truncate(wal, record)


@pytest.mark.parametrize("damage", [flip_a_bit, cut_short])
async def test_a_followers_damaged_log_is_caught(
    tmp_path: Path, damage: Callable[[Path, bytes], None]
) -> None:
    """A bit flipped in a follower's log, or the log cut short, in the records holding
    what only it and the leader acknowledged; then the leader killed. The damaged
    follower restarts repairing and does not vote: with the lagging one alone, which
    lacks those values, no leader is elected until the old leader is back; then nothing
    acknowledged is lost."""
    async with replicated_stream(tmp_path, *FAST) as (replicas, info):
        leader = info.leader
        flipped, lagging = followers(replicas, leader)
        first = await Producer.on(replicas[leader], "v", RETRY)
        await first.wait_acked(20)
        # What is acknowledged from here on is on the leader's disk and the flipped
        # follower's only.
        await replicas.kill(lagging)
        since = len(first.acked)
        await first.wait_acked(20, since=time.monotonic())
        await first.stop()
        await replicas.kill(flipped)
        damage(replicas.data_dir(flipped) / "raft.wal", b"v%d" % first.acked[since + 5])
        await replicas.kill(leader)
        await replicas.restart(flipped)
        await replicas.restart(lagging)
        # The flipped follower does not vote until repaired: the lagging one alone
        # lacks what was acknowledged, so no leader may be elected without the old one.
        second = await Producer.on(replicas[lagging], "w", RETRY)
        await refused_meanwhile(second, since=0.0)
        await replicas.restart(leader)
        restarted_at = time.monotonic()
        assert await second.wait_acked(10, since=restarted_at) < RESUME_WITHIN
        await second.stop()
        await check_copies(replicas, [first, second])


async def test_a_draining_leader_hands_its_leadership_over_first(tmp_path) -> None:
    """Not a fault, an operation: a drain moves the broker's stream leaderships before
    its connectors (the Raft core's leadership transfer), so a follower leads while the
    drained broker is still up -- here held draining by a connector that ignores its
    MOVE -- and appends go on without waiting an election timeout for its loss."""
    from tests.integration.helpers import RawLink

    grace = 20 * ELECTION
    async with replicated_stream(tmp_path, *FAST, "--drain-grace", str(grace)) as (replicas, _):
        first = replicas.names[0]
        producer = await Producer.on(replicas[first], "f", RETRY)
        await producer.wait_acked(20)
        async with await meshbus.connect(replicas[first].address, server="c") as conn:
            leader = await leader_seen_by(conn)  # the one that acknowledged those
        assert leader
        watcher = replicas[next(n for n in followers(replicas, leader) if n != first)]
        consumer = await Consumer.on(watcher)
        straggler = await RawLink.open(replicas[leader].address)
        try:
            await straggler.hello("straggler")
            await straggler.register("straggler", 1)
            async with await meshbus.connect(watcher.address, server="c") as conn:
                drained_at = time.monotonic()
                replicas[leader].process.send_signal(signal.SIGTERM)  # a drain
                await led_by_another(conn, leader, "a follower leading", grace / 2)
                exited = replicas[leader].process.returncode
                assert exited is None, f"the leader changed once it was gone ({exited})"
                assert time.monotonic() - drained_at < grace / 2
                assert await producer.wait_acked(10, since=time.monotonic()) < RESUME_WITHIN
        finally:
            await straggler.close()
        await producer.stop()
        assert await replicas[leader].process.wait() == 0
        await check_copies(replicas, [producer], consumer)
        await consumer.stop()


async def test_a_leader_whose_disk_fills_is_replaced_and_loses_nothing(tmp_path) -> None:
    """The leader's disk fills: its Raft log's next write fails, which stops its driver
    (it acknowledges nothing more), and the followers elect one of them; appends are
    acknowledged again within a few election timeouts. With room again and restarted, it
    catches up: nothing acknowledged lost, the copies the same."""
    with disks_of_their_own(tmp_path, ["r0", "r1", "r2"]):
        async with replicated_stream(tmp_path, *FAST) as (replicas, info):
            leader = info.leader
            follower, other = followers(replicas, leader)
            producer = await Producer.on(replicas[follower], "v", RETRY)
            consumer = await Consumer.on(replicas[other])
            await producer.wait_acked(20)
            filled_at = time.monotonic()
            ballast = fill(replicas.data_dir(leader))
            assert await producer.wait_acked(20, since=filled_at) < RESUME_WITHIN
            async with await meshbus.connect(replicas[follower].address, server="c") as conn:
                await led_by_another(conn, leader, "a leader other than the full one", 10)
            ballast.unlink()
            replicas[leader].process.kill()
            await replicas[leader].process.wait()
            await replicas.restart(leader)
            await producer.wait_acked(10, since=time.monotonic())
            await stopped_and_checked(replicas, [producer], consumer)
