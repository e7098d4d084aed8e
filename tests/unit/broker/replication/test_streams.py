"""What every broker computes alike for a replicated stream: its member address; and
three replicas' ``ReplicatedStreams`` in one process, with real drivers, logs and
stores, applying the same entries."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from meshbus.address import CAST_UNICAST, DYNAMIC_INSTANCE_MIN, Address, Unicast
from meshbus.broker.replication.compaction import CompactionPolicy
from meshbus.broker.replication.consumers import ConsumerCommand
from meshbus.broker.replication.driver import RaftDriver, ReplicationError
from meshbus.broker.replication.meta import ConfigBody
from meshbus.broker.replication.streams import (
    ReplicatedStreams,
    member_address,
    member_session,
)
from meshbus.protocol.codec import encode_control
from meshbus.protocol.control import DECODERS, RaftChunkBody, RaftFetchBody, RaftFrame
from meshbus.protocol.layout import CONTROL_HEADER_SIZE, ControlType
from meshbus.raft import Message, RaftSettings
from meshbus.storage.errors import ConsumerNotFound
from meshbus.storage.raftlog import RaftWal
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import ConsumerConfig, ConsumerInfo, NewMessage, StreamConfig


def test_the_member_address_is_a_unicast_no_broker_allocates() -> None:
    raw = member_address("orders")
    assert raw == member_address("orders") != member_address("ledger")
    address = Address.from_bytes(raw)
    assert isinstance(address, Unicast)
    assert raw[0] == CAST_UNICAST
    assert address.server == "rstream"
    assert address.instance >= DYNAMIC_INSTANCE_MIN  # no connector registers it as fixed
    assert member_session("orders") != member_session("ledger")
    assert len(member_session("orders")) <= 64  # a session's wire limit (MAX_SESSION)


# -- three replicas in one process: real drivers, logs and SQLite stores ----------------


class Replica:
    """One broker's ``ReplicatedStreams``, its store and what its hooks were told."""

    def __init__(
        self,
        name: str,
        tmp: Path,
        in_flight: list[tuple[str, str, str, Any]],
        compaction: CompactionPolicy | None = None,
    ) -> None:
        self.name = name
        self.store = SqliteStreamStore(tmp / f"{name}.db")
        self.wal, _ = RaftWal.open(str(tmp / f"{name}.wal"))
        self.acks: list[dict[bytes, list[int]]] = []
        wire = Wire(name, in_flight)

        def driver(machine: ReplicatedStreams) -> RaftDriver:
            return RaftDriver(
                name=lambda: name,
                wal=self.wal,
                transport=wire,
                machine=machine,
                settings=SETTINGS,
                randomness=random.Random(NAMES.index(name)),
                run_blocking=inline,
                compaction=compaction,
                rewrite_slack=64 * 1024,
            )

        self.streams = ReplicatedStreams(
            name=lambda: name,
            store=self.store,
            # founding goes by ``found`` here; the rest as Wire carries it
            transport=wire,  # type: ignore[arg-type]
            driver=driver,
            capture=lambda *_: None,
            release=lambda _: None,
            deleted=lambda _: None,
            acknowledge=lambda _, acks: self.acks.append(acks),
            entry_limit=16 * 1024,
            linked=lambda _: True,
            copy_retry=SETTINGS.election_ticks,
        )


class Wire:
    """What PeerTransport sends, held until ``Replicas.turns`` delivers it: Raft messages,
    and a copy's requests and answers (each checked to fit in a frame of ``FRAME``)."""

    def __init__(self, sender: str, in_flight: list[tuple[str, str, str, Any]]) -> None:
        self.sender = sender
        self.in_flight = in_flight

    def send(self, broker: str, group: str, messages: Sequence[Message]) -> None:
        self.in_flight.append((self.sender, broker, group, messages))

    def fetch(self, broker: str, group: str, body: RaftFetchBody) -> None:
        self.in_flight.append((self.sender, broker, group, body))

    def chunk(self, broker: str, group: str, body: RaftChunkBody) -> None:
        frame = encode_control(
            ControlType.RAFT, RaftFrame(group=group, chunk=body), max_frame=FRAME
        )
        sent = DECODERS[ControlType.RAFT].decode(frame[CONTROL_HEADER_SIZE:])
        self.in_flight.append((self.sender, broker, group, sent.chunk))


async def inline(work: Callable[[], None]) -> None:
    work()


NAMES = ("b1", "b2", "b3")
SETTINGS = RaftSettings(election_ticks=10, heartbeat_ticks=1, max_append_entries=4)
FRAME = 128 * 1024  # the peers' frame limit: 8 times the entry limit, as a broker's
GROUP = bytes([2]) + bytes(15)


class Replicas:
    def __init__(self, tmp: Path, compaction: CompactionPolicy | None = None) -> None:
        self.in_flight: list[tuple[str, str, str, Any]] = []
        self.by_name = {name: Replica(name, tmp, self.in_flight, compaction) for name in NAMES}
        self.cut: set[str] = set()  # brokers whose frames are dropped, both ways

    async def turns(self, rounds: int = 30) -> None:
        """Turns and deliveries until nothing moves (or ``rounds``), then a tick (a
        heartbeat carries the commit index to the followers) and the same again."""
        for tick in (False, True, False):
            if tick:
                for replica in self.by_name.values():
                    replica.streams.driver.tick()
            for _ in range(rounds):
                await asyncio.sleep(0)  # the consumer commands of this turn proposed
                for replica in self.by_name.values():
                    await replica.streams.driver.turn()
                flying, self.in_flight[:] = list(self.in_flight), []
                for sender, to, group, what in flying:
                    if sender in self.cut or to in self.cut:
                        continue
                    streams = self.by_name[to].streams
                    if isinstance(what, RaftFetchBody):
                        streams.copies.serve(sender, group, what)
                    elif isinstance(what, RaftChunkBody):
                        streams.copies.received(sender, group, what, streams.driver.now)
                    else:
                        streams.driver.receive(sender, group, what)
                if not flying:
                    break

    async def found(self, config: StreamConfig) -> Replica:
        app = msgspec.msgpack.encode(ConfigBody.of(config))
        for replica in self.by_name.values():
            replica.streams.found(config.name, list(NAMES), app)
        for _ in range(100):
            leaders = [r for r in self.by_name.values() if r.streams.leads(config.name)]
            if leaders:
                await self.turns()
                return leaders[0]
            for replica in self.by_name.values():
                replica.streams.driver.tick()
            await self.turns()
        raise AssertionError("no leader elected in 100 ticks")

    def close(self) -> None:
        for replica in self.by_name.values():
            replica.streams.driver.close()
            replica.store.close()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    made = Replicas(tmp_path)
    yield made
    made.close()


async def test_consumers_and_retention_go_through_the_log_to_every_replica(
    replicas: Replicas,
) -> None:
    config = StreamConfig("ledger", (GROUP,), max_age=60.0)
    leader = await replicas.found(config)
    leads = leader.streams
    messages = [NewMessage(bytes(16), GROUP, b"m%d" % i, publish_id=b"p%d" % i) for i in range(6)]
    leads.append("ledger", member_address("ledger"), messages, {b"src": [1]})
    await replicas.turns()
    assert leader.acks == [{b"src": [1]}]  # acknowledged once committed and applied
    added = leads.consume("ledger", ConsumerCommand.add(ConsumerConfig("work", ack_wait=5.0)))
    taken = leads.consume("ledger", ConsumerCommand.next("work", 4))
    await replicas.turns()
    assert isinstance(added.result(), ConsumerInfo)
    deliveries = taken.result()
    assert isinstance(deliveries, list)
    assert [d.message.payload for d in deliveries] == [b"m0", b"m1", b"m2", b"m3"]
    acked = leads.consume("ledger", ConsumerCommand.ack("work", [1, 2]))
    missing = leads.consume("ledger", ConsumerCommand.next("gone", 1))
    await replicas.turns()
    assert acked.result() == 2
    with pytest.raises(ConsumerNotFound):
        missing.result()
    states = {
        name: (info.next_seq, info.ack_floor, info.pending, r.store.applied("ledger"))
        for name, r in replicas.by_name.items()
        for info in [r.store.consumer_info("ledger", "work")]
    }
    assert len(set(states.values())) == 1, states
    assert next(iter(states.values()))[:3] == (5, 2, 2)
    # Retention by age: proposed by the leader at its clock, applied alike everywhere.
    follower = next(r for r in replicas.by_name.values() if r is not leader)
    follower.streams.expire(time.time() + 3600)  # not the leader: proposes nothing
    await replicas.turns()
    assert {r.store.info("ledger").messages for r in replicas.by_name.values()} == {6}
    leads.expire(time.time() + 3600)
    await replicas.turns()
    for replica in replicas.by_name.values():
        info = replica.store.info("ledger")
        assert (info.first_seq, info.messages) == (7, 0), replica.name
        assert replica.store.consumer_info("ledger", "work").pending == 0  # gone with them
    # A follower asked is told to ask the leader: not committed.
    refused = follower.streams.consume("ledger", ConsumerCommand.next("work", 1))
    await replicas.turns()
    with pytest.raises(ReplicationError, match="not the leader"):
        refused.result()


async def test_an_entry_a_replica_cannot_read_stops_the_stream_there(replicas: Replicas) -> None:
    leader = await replicas.found(StreamConfig("ledger", (GROUP,)))
    bad = ConsumerCommand.ack("work", [2**41])  # past any seq: not what a leader proposes
    leader.streams.driver.propose("ledger", msgspec.msgpack.encode((2, 0.0, [1, 1, [bad]])))
    await replicas.turns()
    for replica in replicas.by_name.values():  # logged; the broker goes on without it
        assert "ledger" not in replica.streams.driver.groups, replica.name


# -- snapshots: a follower behind a compacted log copies the stream --------------------------

COMPACTION = CompactionPolicy(entries=16, bytes=1 << 20)


def stream_of(replica: Replica) -> tuple[Any, ...]:
    """Everything a replica holds of the stream: its counters, its messages (seq, time
    and body), its consumer, the Raft index applied."""
    store = replica.store
    info = store.info("ledger")
    held = store.read("ledger", 1, 1 << 20)
    consumer = store.consumer_info("ledger", "work")
    return (info, held, consumer, store.applied("ledger"))


async def appended(
    leader: Replica, replicas: Replicas, batches: int, size: int = 64, first: int = 0
) -> None:
    """``batches`` turns of 8 messages of ``size`` bytes each (publish ids "BATCH-i", the
    batches numbered from ``first``), the consumer taking and acknowledging some of them
    as it goes."""
    for batch in range(first, first + batches):
        messages = [
            NewMessage(
                bytes(16),
                GROUP,
                b"%d.%d" % (batch, i) + bytes(size),
                publish_id=b"%d-%d" % (batch, i),
            )
            for i in range(8)
        ]
        leader.streams.append("ledger", member_address("ledger"), messages, {})
        leader.streams.consume("ledger", ConsumerCommand.next("work", 3))
        if batch % 3 == 0:
            leader.streams.consume("ledger", ConsumerCommand.ack("work", [batch * 2 + 1]))
        await replicas.turns()


async def caught_up(replicas: Replicas, rounds: int = 200) -> None:
    for _ in range(rounds):
        applied = {r.store.applied("ledger") for r in replicas.by_name.values()}
        copying = any(r.streams.copies.copying("ledger") for r in replicas.by_name.values())
        if len(applied) == 1 and not copying:
            return
        await replicas.turns()
    raise AssertionError(f"not caught up: {applied}")


@pytest.fixture
def compacting(tmp_path: Path) -> Iterator[Replicas]:
    made = Replicas(tmp_path, COMPACTION)
    yield made
    made.close()


async def test_a_follower_behind_the_compacted_log_copies_the_stream_and_follows(
    compacting: Replicas,
) -> None:
    replicas = compacting
    config = StreamConfig("ledger", (GROUP,), max_msgs=200)  # retention moves first_seq
    leader = await replicas.found(config)
    leader.streams.consume("ledger", ConsumerCommand.add(ConsumerConfig("work", ack_wait=60.0)))
    await replicas.turns()
    behind = next(r for r in replicas.by_name.values() if r is not leader)
    replicas.cut.add(behind.name)
    await appended(leader, replicas, 80)
    log = leader.streams.driver.groups["ledger"].node.log
    # The leader kept no more than twice the threshold, though a follower lacks them all.
    assert log.snapshot.index > behind.store.applied("ledger") + 16
    assert log.last_index - log.snapshot.index < 2 * COMPACTION.entries + 8
    assert leader.store.info("ledger").first_seq > 1
    replicas.cut.clear()
    await caught_up(replicas)
    assert behind.streams.driver.stats.snapshots_installed == 1
    assert behind.streams.copies.copied_blocks > 0
    states = {r.name: stream_of(r) for r in replicas.by_name.values()}
    assert states[behind.name] == states[leader.name]
    # It follows by entries from there on, and every replica compacts its own log; a
    # resend of messages retention removed (batch 0) is a duplicate on it too: their
    # publish ids came with the copy.
    assert behind.store.info("ledger").first_seq > 8
    await appended(leader, replicas, 1, first=0)
    await appended(leader, replicas, 10, first=80)
    await caught_up(replicas)
    assert leader.store.info("ledger").last_seq == 90 * 8
    states = {r.name: stream_of(r) for r in replicas.by_name.values()}
    assert len({repr(state) for state in states.values()}) == 1, states
    for replica in replicas.by_name.values():
        assert replica.streams.driver.stats.compactions > 0, replica.name
        assert replica.wal.groups["ledger"].snapshot.index > 0, replica.name


async def test_a_copy_cut_short_goes_on_from_the_next_leader(compacting: Replicas) -> None:
    """The copy takes several chunks; its source stops leading half way (cut off); the
    next leader's snapshot has the copy go on from what was staged, not from the start."""
    replicas = compacting
    leader = await replicas.found(StreamConfig("ledger", (GROUP,)))
    leader.streams.consume("ledger", ConsumerCommand.add(ConsumerConfig("work", ack_wait=60.0)))
    await replicas.turns()
    behind, other = (r for r in replicas.by_name.values() if r is not leader)
    replicas.cut.add(behind.name)
    await appended(leader, replicas, 60, size=1024)  # 500 KB: many chunks of 32 KB
    replicas.cut.clear()
    for _ in range(50):
        if behind.streams.copies.copied_blocks >= 3:
            break
        await replicas.turns(rounds=1)
    assert behind.streams.copies.copying("ledger")
    staged = behind.streams.copies.copied_blocks
    replicas.cut.add(leader.name)
    for _ in range(100):
        if other.streams.leads("ledger"):
            break
        await replicas.turns()
    assert other.streams.leads("ledger")
    for _ in range(200):
        if not behind.streams.copies.copying("ledger"):
            break
        await replicas.turns()
    assert behind.store.applied("ledger") == other.store.applied("ledger")
    assert stream_of(behind) == stream_of(other)
    # Every block was copied once: those staged from the first leader were kept.
    assert behind.streams.copies.copied_blocks == len(
        behind.store.read_blocks("ledger", 1, 1 << 20)
    )
    assert staged < behind.streams.copies.copied_blocks


async def test_replicas_restarted_after_compactions_read_their_snapshots_back(
    tmp_path: Path,
) -> None:
    """Every replica stopped after its log was compacted, and started again from its
    files: each node starts from its snapshot (its roster with it), each store skips what
    it applied, a leader is elected and the stream goes on, the same everywhere."""
    replicas = Replicas(tmp_path, COMPACTION)
    leader = await replicas.found(StreamConfig("ledger", (GROUP,)))
    leader.streams.consume("ledger", ConsumerCommand.add(ConsumerConfig("work", ack_wait=60.0)))
    await replicas.turns()
    await appended(leader, replicas, 40)
    await caught_up(replicas)
    before = {name: stream_of(r) for name, r in replicas.by_name.items()}
    replicas.close()
    again = Replicas(tmp_path, COMPACTION)
    try:
        for replica in again.by_name.values():
            assert replica.wal.groups["ledger"].snapshot.index > 0, replica.name
            replica.streams.restore()
        assert {name: stream_of(r) for name, r in again.by_name.items()} == before
        for _ in range(100):
            leaders = [r for r in again.by_name.values() if r.streams.leads("ledger")]
            if leaders:
                break
            await again.turns()
        else:
            raise AssertionError("no leader elected in 100 ticks")
        await appended(leaders[0], again, 5, first=40)
        await caught_up(again)
        states = {repr(stream_of(r)) for r in again.by_name.values()}
        assert len(states) == 1
        assert leaders[0].store.info("ledger").last_seq == 45 * 8
    finally:
        again.close()
