"""Durable consumers of replicated streams: their commands applied to real stores (the
memory and the SQLite one), as every replica applies a committed entry; and the
leader's side, which gathers a turn's commands into one entry and hands each request
its outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshbus.broker.replication.consumers import (
    CommandBatch,
    ConsumerCommand,
    ConsumerCommands,
    apply_commands,
)
from meshbus.broker.replication.driver import ReplicationError
from meshbus.storage.errors import ConsumerExists, ConsumerNotFound
from meshbus.storage.sqlite import SqliteStreamStore
from meshbus.storage.store import (
    ConsumerConfig,
    ConsumerInfo,
    MemoryStreamStore,
    MirroredStore,
    NewMessage,
    StreamConfig,
)

STREAM = "ledger"
GROUP = bytes([2]) + bytes(15)
CONFIG = StreamConfig(STREAM, (GROUP,))


def fresh(kind: str, path: Path) -> MirroredStore:
    store: MirroredStore = MemoryStreamStore() if kind == "memory" else SqliteStreamStore(path)
    store.add_stream(CONFIG)
    return store


@pytest.fixture(params=["memory", "sqlite"])
def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[MirroredStore]]:
    """Two replicas' stores of the stream, each holding messages 1..10 (entry 1)."""
    stores = [fresh(request.param, tmp_path / f"{i}.db") for i in range(2)]
    for store in stores:
        messages = [NewMessage(bytes(16), GROUP, b"m%d" % i) for i in range(1, 11)]
        store.append_entry(STREAM, messages, 100.0, 1)
    yield stores
    for store in stores:
        store.close()


def apply_everywhere(
    stores: list[MirroredStore], commands: list[ConsumerCommand], now: float, index: int
) -> list[object]:
    """The entry applied by every replica, the first one reading its deliveries (it
    answers them); the first one's outcomes."""
    outcomes = [
        apply_commands(store, STREAM, commands, now, index, read=i == 0)
        for i, store in enumerate(stores)
    ]
    return list(outcomes[0])


def states(stores: list[MirroredStore], name: str) -> list[tuple[object, ...]]:
    return [
        (info.next_seq, info.ack_floor, info.pending, info.dropped, store.applied(STREAM))
        for store in stores
        for info in [store.consumer_info(STREAM, name)]
    ]


def test_every_replica_holds_the_same_position_after_the_same_entries(
    replicas: list[MirroredStore],
) -> None:
    work = ConsumerConfig("work", ack_wait=5.0, max_deliver=2, owner="ann")
    added, taken = apply_everywhere(
        replicas, [ConsumerCommand.add(work), ConsumerCommand.next("work", 4)], 200.0, 2
    )
    assert isinstance(added, ConsumerInfo)
    assert (added.config, added.next_seq) == (work, 1)
    assert isinstance(taken, list)
    assert [(d.message.seq, d.message.payload, d.delivery) for d in taken] == [
        (1, b"m1", 1), (2, b"m2", 1), (3, b"m3", 1), (4, b"m4", 1)
    ]  # fmt: skip
    # Acks of 1 and 3 (and of 9, never delivered: it counts 0), then a next past the
    # ack wait: 2 and 4 come again with their second delivery, then 5 and 6.
    acked, again = apply_everywhere(
        replicas, [ConsumerCommand.ack("work", [1, 3, 9]), ConsumerCommand.next("work", 4)],
        206.0, 3,
    )  # fmt: skip
    assert acked == 2
    assert isinstance(again, list)
    assert [(d.message.seq, d.delivery) for d in again] == [(2, 2), (4, 2), (5, 1), (6, 1)]
    # The third time they are due, 2 and 4 are given up (max_deliver 2), alike everywhere.
    (last,) = apply_everywhere(replicas, [ConsumerCommand.next("work", 1)], 212.0, 4)
    assert isinstance(last, list)
    assert [(d.message.seq, d.delivery) for d in last] == [(5, 2)]
    assert states(replicas, "work") == [(7, 4, 2, 2, 4)] * 2
    # The one that does not answer read nothing, and recorded the same deliveries.
    assert replicas[1].consumer_info(STREAM, "work") == replicas[0].consumer_info(STREAM, "work")


def test_a_refused_command_changes_nothing_and_the_others_apply(
    replicas: list[MirroredStore],
) -> None:
    apply_everywhere(replicas, [ConsumerCommand.add(ConsumerConfig("work"))], 200.0, 2)
    other = ConsumerConfig("work", ack_wait=1.0)
    bad = ConsumerCommand(0, "no spaces allowed")  # ADD of a name no consumer may have
    outcomes = apply_everywhere(
        replicas,
        [
            ConsumerCommand.add(other),  # another configuration: ConsumerExists
            ConsumerCommand.next("gone", 5),  # no such consumer
            bad,
            ConsumerCommand.next("work", 2),
            ConsumerCommand(9, "work"),  # a command this broker does not know
        ],
        201.0,
        3,
    )
    assert isinstance(outcomes[0], ConsumerExists)
    assert isinstance(outcomes[1], ConsumerNotFound)
    assert isinstance(outcomes[2], ValueError)
    assert "invalid consumer name" in str(outcomes[2])
    assert [d.message.seq for d in outcomes[3]] == [1, 2]  # type: ignore[union-attr]
    assert isinstance(outcomes[4], ValueError)
    assert states(replicas, "work") == [(3, 0, 2, 0, 3)] * 2
    assert [s.consumers for s in map(lambda r: r.info(STREAM), replicas)] == [("work",)] * 2
    (deleted,) = apply_everywhere(replicas, [ConsumerCommand.delete("work")], 202.0, 4)
    assert deleted is None
    assert [r.info(STREAM).consumers for r in replicas] == [()] * 2
    assert [r.applied(STREAM) for r in replicas] == [4, 4]


def test_a_restart_keeps_the_consumer_and_the_index_applied_with_it(tmp_path: Path) -> None:
    store = fresh("sqlite", tmp_path / "s.db")
    store.append_entry(STREAM, [NewMessage(bytes(16), GROUP, b"x")] * 3, 100.0, 1)
    commands = [
        ConsumerCommand.add(ConsumerConfig("work")),
        ConsumerCommand.next("work", 2),
        ConsumerCommand.ack("work", [1]),
    ]
    apply_commands(store, STREAM, commands, 200.0, 2, read=False)
    before = store.consumer_info(STREAM, "work")
    store.close()
    again = SqliteStreamStore(tmp_path / "s.db")
    try:
        assert again.applied(STREAM) == 2  # the entry is not applied a second time
        assert again.consumer_info(STREAM, "work") == before
        assert (before.next_seq, before.ack_floor, before.pending) == (3, 1, 1)
    finally:
        again.close()


class Proposals:
    """What the leader proposed: each entry's stream, batch and future."""

    def __init__(self) -> None:
        self.made: list[tuple[str, CommandBatch, asyncio.Future[int]]] = []

    def __call__(self, stream: str, batch: CommandBatch) -> asyncio.Future[int]:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.made.append((stream, batch, future))
        return future


async def test_a_turns_commands_go_as_one_entry_per_stream_and_each_gets_its_outcome() -> None:
    proposals = Proposals()
    commands = ConsumerCommands(proposals, entry_limit=16 * 1024, proposer=7)
    acks = [commands.submit(STREAM, ConsumerCommand.ack("work", [i])) for i in range(50)]
    other = commands.submit("other", ConsumerCommand.next("work", 10))
    await asyncio.sleep(0)  # the end of the turn
    assert [(s, b.proposer, len(b.commands)) for s, b, _ in proposals.made] == [
        (STREAM, 7, 50), ("other", 7, 1)
    ]  # fmt: skip
    (_, batch, entry), (_, other_batch, other_entry) = proposals.made
    assert commands.waits_for(batch)
    assert not commands.waits_for(CommandBatch(8, batch.serial, []))  # another broker's
    commands.settle(batch, [1] * 49 + [ConsumerNotFound(STREAM, "work")])
    entry.set_result(5)
    assert [a.result() for a in acks[:49]] == [1] * 49
    with pytest.raises(ConsumerNotFound):
        acks[49].result()
    assert not commands.waits_for(batch)
    # Not committed here: the request is told to ask again.
    other_entry.set_exception(ReplicationError("leadership moved"))
    await asyncio.sleep(0)
    with pytest.raises(ReplicationError, match=r"not committed \(leadership moved\); ask again"):
        other.result()
    assert not commands.waits_for(other_batch)


async def test_commands_past_the_entry_limit_go_in_more_entries_and_a_big_ack_is_split() -> None:
    proposals = Proposals()
    commands = ConsumerCommands(proposals, entry_limit=1024, proposer=7)
    nexts = [commands.submit(STREAM, ConsumerCommand.next(f"w{i}", 1)) for i in range(12)]
    acked = commands.submit(STREAM, ConsumerCommand.ack("work", list(range(1, 201))))
    await asyncio.sleep(0)
    sizes = [sum(c.weight for c in batch.commands) for _, batch, _ in proposals.made]
    assert all(size <= 1024 for size in sizes), sizes
    made = [c for _, batch, _ in proposals.made for c in batch.commands]
    assert [c.consumer for c in made[:12]] == [f"w{i}" for i in range(12)]
    assert [s for c in made[12:] for s in c.seqs] == list(range(1, 201))
    assert len(made) > 13  # the ack went as several commands
    for _, batch, future in proposals.made:
        outcomes = [len(c.seqs) if c.seqs else [] for c in batch.commands]
        commands.settle(batch, outcomes)
        future.set_result(1)
    assert [n.result() for n in nexts] == [[]] * 12
    await asyncio.sleep(0)
    assert acked.result() == 200
