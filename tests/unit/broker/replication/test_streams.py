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
from meshbus.broker.replication.consumers import ConsumerCommand
from meshbus.broker.replication.driver import RaftDriver, ReplicationError
from meshbus.broker.replication.streams import (
    ConfigBody,
    ReplicatedStreams,
    member_address,
    member_session,
)
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

    def __init__(self, name: str, tmp: Path, in_flight: list[tuple[str, str, str, Any]]) -> None:
        self.name = name
        self.store = SqliteStreamStore(tmp / f"{name}.db")
        self.wal, _ = RaftWal.open(str(tmp / f"{name}.wal"))
        self.acks: list[dict[bytes, list[int]]] = []

        def driver(machine: ReplicatedStreams) -> RaftDriver:
            return RaftDriver(
                name=lambda: name,
                wal=self.wal,
                transport=Wire(name, in_flight),
                machine=machine,
                settings=SETTINGS,
                randomness=random.Random(NAMES.index(name)),
                run_blocking=inline,
            )

        self.streams = ReplicatedStreams(
            name=lambda: name,
            store=self.store,
            transport=None,  # type: ignore[arg-type]  # founding goes by ``found`` here
            driver=driver,
            capture=lambda *_: None,
            release=lambda _: None,
            deleted=lambda _: None,
            acknowledge=lambda _, acks: self.acks.append(acks),
            entry_limit=16 * 1024,
            linked=lambda _: True,
        )


class Wire:
    def __init__(self, sender: str, in_flight: list[tuple[str, str, str, Any]]) -> None:
        self.sender = sender
        self.in_flight = in_flight

    def send(self, broker: str, group: str, messages: Sequence[Message]) -> None:
        self.in_flight.append((self.sender, broker, group, messages))


async def inline(work: Callable[[], None]) -> None:
    work()


NAMES = ("b1", "b2", "b3")
SETTINGS = RaftSettings(election_ticks=10, heartbeat_ticks=1)
GROUP = bytes([2]) + bytes(15)


class Replicas:
    def __init__(self, tmp: Path) -> None:
        self.in_flight: list[tuple[str, str, str, Any]] = []
        self.by_name = {name: Replica(name, tmp, self.in_flight) for name in NAMES}

    async def turns(self) -> None:
        """Turns and deliveries until nothing moves, then a tick (a heartbeat carries the
        commit index to the followers) and the same again."""
        for tick in (False, True, False):
            if tick:
                for replica in self.by_name.values():
                    replica.streams.driver.tick()
            for _ in range(30):
                await asyncio.sleep(0)  # the consumer commands of this turn proposed
                for replica in self.by_name.values():
                    await replica.streams.driver.turn()
                flying, self.in_flight[:] = list(self.in_flight), []
                for sender, to, group, messages in flying:
                    self.by_name[to].streams.driver.receive(sender, group, messages)
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
